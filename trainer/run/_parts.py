"""The parts of a run that are started and always stopped: Ray cluster, engines, workers.

Each is an async context manager that :func:`trainer.run._train.train` enters in this order
(cluster, engines, workers, weight transport) and so leaves in reverse, whatever the
error: transport closed, workers shut down, engines stopped, the Ray cluster left (stopped
when the run started it). Modules that import Ray are imported only by runs that use it
(importing Ray costs seconds), hence the imports inside functions below.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from engines.client import InferenceClient
from engines.devices import resolve_device, resolve_dtype
from engines.launch import (
    EngineProcesses,
    ReferenceServers,
    ServersSpec,
    open_engine_processes,
)
from engines.routes import DATA_PLANE_ROUTES, PAUSE_ROUTES, SLEEP_ROUTES, WEIGHT_TRANSFER_ROUTES
from engines.vllm_inprocess import open_vllm_inprocess_client
from engines.vllm_serve import VLLM_TRANSPORTS, VllmServers, check_server_config, gpu_groups
from engines.weight_transfer import dtype_name
from sync.transports import (
    BroadcastTransport,
    DiskTransport,
    InProcessTransport,
    IpcTransport,
    WeightTransport,
)
from trainer.config import Config
from trainer.errors import ConfigError
from trainer.off_policy import resolve_correction
from trainer.workers.group import WorkerGroup
from trainer.workers.local import LocalWorkerGroup

__all__ = [
    "CpuThreads",
    "Engines",
    "cpu_threads",
    "make_transport",
    "open_engine",
    "open_engines",
    "open_ray_cluster",
    "open_transport",
    "open_workers",
    "refuse_sleep_on_the_cpu",
    "uses_ray",
]

log = logging.getLogger("trainer.run")
#: Default of ``engine.startup_timeout_s`` for vLLM engines.
VLLM_STARTUP_TIMEOUT_S = 900.0
#: How long closing the weight transport (rank 0 leaving its group) may take.
TRANSPORT_CLOSE_TIMEOUT_S = 30.0


@attrs.frozen
class Engines:
    """The run's engines: their client, and the servers the trainer started as processes."""

    client: Any
    #: ``engine.backend=local`` or ``vllm`` with ``placement=process``: the server processes
    #: (restartable); None for every other backend and placement.
    processes: EngineProcesses | None = None


@asynccontextmanager
async def open_engine(cfg: Config, model_dir: Path, run_dir: Path) -> AsyncIterator[Any]:
    """:func:`open_engines`' client."""
    async with open_engines(cfg, model_dir, run_dir) as engines:
        yield engines.client


@asynccontextmanager
async def open_engines(cfg: Config, model_dir: Path, run_dir: Path) -> AsyncIterator[Engines]:
    """The engines of ``engine.backend`` and their client.

    Servers the trainer starts are stopped when the block exits, whatever the error. Every
    server is probed for the routes the run uses (naming the ``vllm serve`` flag behind a
    missing one); a vLLM server's config must have the run's weight-transfer backend.
    """
    e = cfg.engine
    devices = [f"cuda:{i}" for i in e.gpu_ids] if e.device == "cuda" and e.gpu_ids else [e.device]
    if e.backend == "inprocess" or (e.backend == "local" and e.placement == "process"):
        for device in devices:  # here, before a server starts: a clear ConfigError
            resolve_device(device, key="engine.device")
    sleeps = sleeps_engines(cfg)
    routes = (*DATA_PLANE_ROUTES, *PAUSE_ROUTES, *WEIGHT_TRANSFER_ROUTES)
    routes = (*routes, *SLEEP_ROUTES) if sleeps else routes
    if e.backend == "vllm_inprocess":
        assert cfg.sync.transport in VLLM_TRANSPORTS, "validate_cfg allows only vLLM's backends"
        refuse_sleep_on_the_cpu(cfg, not torch.cuda.is_available())
        async with open_vllm_inprocess_client(
            model_dir,
            tensor_parallel_size=e.tensor_parallel_size,
            gpu_memory_utilization=e.gpu_memory_utilization,
            seed=cfg.trainer.seed,
            enable_sleep_mode=sleeps,
            weight_transfer_backend=cfg.sync.transport,
            extra_args=e.extra_args,
            dtype=policy_dtype(cfg),
            cpu=not torch.cuda.is_available(),
            control_plane_timeout_s=e.control_plane_timeout_s,
            startup_timeout_s=startup_timeout_s(cfg),
        ) as client:
            await client.probe(routes)
            yield Engines(client)
        return
    if e.backend == "inprocess":
        from engines.local.inprocess import open_inprocess_client

        async with open_inprocess_client(
            model_dir, seed=cfg.trainer.seed, device=devices[0]
        ) as client:
            yield Engines(client)
        return
    async with AsyncExitStack() as stack:
        processes = None
        if e.backend == "remote":
            urls = list(e.urls)
        else:
            started = await _start_servers(stack, cfg, model_dir, run_dir / "engines", devices)
            urls = [engine.url for engine in started]
            processes = started if isinstance(started, EngineProcesses) else None
        client = await stack.enter_async_context(
            InferenceClient(
                urls,
                api_key=e.api_key,
                max_concurrency=e.max_concurrency,
                control_plane_timeout_s=e.control_plane_timeout_s,
            )
        )
        await client.probe(routes)
        await check_server_config(client, cfg.sync.transport, needs_sleep=sleeps)
        yield Engines(client, processes)


def startup_timeout_s(cfg: Config) -> float:
    """``engine.startup_timeout_s``, or its default for the backend."""
    if cfg.engine.startup_timeout_s is not None:
        return cfg.engine.startup_timeout_s
    return VLLM_STARTUP_TIMEOUT_S if cfg.engine.backend.startswith("vllm") else 180.0


def policy_dtype(cfg: Config) -> str:
    """The policy's dtype by name (``float32``, ``bfloat16``): vLLM's ``--dtype``, so it serves
    what the policy trains (it would serve a float32 checkpoint in bfloat16 on the CPU)."""
    policy_device = resolve_device(cfg.workers.device, key="workers.device")
    return dtype_name(resolve_dtype(cfg.workers.dtype, policy_device))


@attrs.frozen
class CpuThreads:
    """torch's intra-op threads on a machine without CUDA: the trainer's, and each reference
    engine server's (``engine.backend=local``)."""

    trainer: int
    server: int


def cpu_threads(cfg: Config, cores: int | None = None) -> CpuThreads:
    """Share the cores between the trainer and the reference engine servers it starts.

    ``trainer.strategy=sync``: generation and training take turns, so the trainer gets every
    core while the servers idle, and the servers split the cores while the trainer waits (a
    135M-parameter model trains 1.7x faster on two threads than on one here). Fully-async:
    the servers roll out while the trainer trains, so each server keeps one thread and the
    trainer the rest (a thread that must wait for a core makes each small forward pass many
    times slower). Other backends: the servers are not the trainer's to size.

    The cores to share are ``OMP_NUM_THREADS`` where it is set (a machine shared with other
    jobs, or the test suite's two workers: set it), else every core of the machine.
    """
    cores = cores or _omp_threads() or os.cpu_count() or 1
    servers = cfg.engine.num_engines if cfg.engine.backend == "local" else 0
    if cfg.trainer.strategy == "sync":
        return CpuThreads(trainer=cores, server=max(1, cores // max(1, servers)))
    return CpuThreads(trainer=max(1, cores - servers), server=1)


def _omp_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def sleeps_engines(cfg: Config) -> bool:
    """Whether the run sleeps its engines during weight syncs (their servers then need
    sleep mode: ``--enable-sleep-mode``)."""
    return cfg.engine.colocated or cfg.engine.offload_kv_for_weight_sync


def refuse_sleep_on_the_cpu(cfg: Config, cpu: bool) -> None:
    """``ConfigError`` when the run sleeps a vLLM engine that runs on the CPU (vLLM's CPU build
    has no sleep mode: it refuses ``--enable-sleep-mode`` at start, and its ``/sleep`` answers
    200 and does nothing)."""
    e = cfg.engine
    if cpu and sleeps_engines(cfg):
        key = "engine.colocated" if e.colocated else "engine.offload_kv_for_weight_sync"
        raise ConfigError(
            f"config: {key}=true sleeps the engine during weight syncs, and vLLM on the CPU "
            "has no sleep mode (it refuses --enable-sleep-mode at start): unset it, or run "
            "vLLM on a GPU"
        )


def vllm_servers(cfg: Config, model_dir: Path) -> VllmServers:
    """The ``vllm serve`` servers of ``engine.backend=vllm`` (see :mod:`engines.vllm_serve`).

    Their ``--dtype`` is :func:`policy_dtype`; ``cpu`` where this process sees no CUDA
    (vLLM's CPU build).
    """
    e = cfg.engine
    transport = cfg.sync.transport
    assert transport in VLLM_TRANSPORTS, "validate_cfg allows only vLLM's backends"
    cpu = not torch.cuda.is_available()
    groups: tuple[tuple[int, ...], ...] = ()
    if e.placement == "process":  # Ray gives its actors their GPUs
        first = 0 if transport == "ipc" else 1
        groups = gpu_groups(e.gpu_ids, e.num_engines, e.tensor_parallel_size, first)
    return VllmServers(
        str(model_dir),
        transport,
        tensor_parallel_size=e.tensor_parallel_size,
        gpu_memory_utilization=e.gpu_memory_utilization,
        seed=cfg.trainer.seed,
        enable_sleep_mode=sleeps_engines(cfg),
        gpu_groups=groups,
        extra_args=e.extra_args,
        dtype=policy_dtype(cfg),
        cpu=cpu,
    )


async def _start_servers(
    stack: AsyncExitStack, cfg: Config, model_dir: Path, log_dir: Path, devices: list[str]
) -> Sequence[Any]:
    """Start the servers of ``engine.backend`` (stopped when ``stack`` closes): the processes
    (placement=process) or the Ray-placed servers, each with its ``url``."""
    e = cfg.engine
    servers: ServersSpec
    if e.backend == "vllm":
        refuse_sleep_on_the_cpu(cfg, not torch.cuda.is_available())
        servers = vllm_servers(cfg, model_dir)
    else:
        servers = ReferenceServers(
            str(model_dir),
            cfg.trainer.seed,
            devices=tuple(devices),
            enable_sleep_mode=sleeps_engines(cfg),
            num_threads=None if torch.cuda.is_available() else cpu_threads(cfg).server,
        )
    started = {"api_key": e.api_key, "startup_timeout_s": startup_timeout_s(cfg)}
    if e.placement == "process":
        engines = await stack.enter_async_context(
            open_engine_processes(e.num_engines, servers, log_dir, **started)
        )
        return engines
    from engines.ray_launch import open_ray_engines
    from trainer.workers.ray_cluster import actor_env

    if e.backend == "local":  # placed by Ray, so the device is resolved on its node
        servers = attrs.evolve(servers, devices=(e.device,))
    gpus = e.tensor_parallel_size if e.backend == "vllm" else 0
    placed = await stack.enter_async_context(
        open_ray_engines(
            e.num_engines,
            servers,
            log_dir,
            num_cpus=e.ray_num_cpus,
            num_gpus=gpus,
            env=actor_env(),
            **started,
        )
    )
    log.info("ray engines up: %s", {p.url: (p.node_ip, p.pid) for p in placed})
    return placed


def make_transport(cfg: Config, run_dir: Path) -> WeightTransport:
    """``sync.transport``: safetensors files, a gloo/NCCL broadcast group, or CUDA IPC.

    ``engine.backend=inprocess`` hands the tensors over in memory.
    """
    if cfg.engine.backend == "inprocess":
        return InProcessTransport()
    bucket_bytes = cfg.sync.bucket_size_mb * 2**20
    if cfg.sync.transport in ("gloo", "nccl"):
        # rank 0 hosts the group at sync.master_address, else at its address the engines reach
        return BroadcastTransport(
            bucket_bytes,
            group_init_timeout_s=cfg.sync.group_init_timeout_s,
            timeout_s=cfg.workers.collective_timeout_s,
            master_address=cfg.sync.master_address,
            backend=cfg.sync.transport,
            packed=cfg.sync.packed is not False,
        )
    if cfg.sync.transport == "ipc":
        return IpcTransport(bucket_bytes)
    return DiskTransport(run_dir / "weight_sync", bucket_bytes)


@asynccontextmanager
async def open_transport(
    cfg: Config, run_dir: Path, engine: Any, workers: WorkerGroup
) -> AsyncIterator[WeightTransport]:
    """The run's weight transport, initialised (engines up, workers created); always closed.

    Closing is shielded and bounded by :data:`TRANSPORT_CLOSE_TIMEOUT_S`.
    """
    transport = make_transport(cfg, run_dir)
    await transport.init(engine, workers)
    try:
        yield transport
    finally:
        with trio.move_on_after(TRANSPORT_CLOSE_TIMEOUT_S, shield=True) as scope:
            await transport.close(workers)
        if scope.cancelled_caught:
            log.warning(
                "closing the weight transport did not finish in %.0fs", TRANSPORT_CLOSE_TIMEOUT_S
            )


@asynccontextmanager
async def open_workers(
    cfg: Config, model_dir: Path, policy_kwargs: dict[str, Any]
) -> AsyncIterator[WorkerGroup]:
    """The worker group of ``workers.backend``, shut down when the block exits, whatever the error.

    ``ray`` needs the run's Ray cluster connected (:func:`open_ray_cluster`). Each policy
    worker gets ``policy_kwargs`` plus the loss's off-policy settings from ``cfg``
    (``algorithm.off_policy_correction``, ``algorithm.tis_cap``) and the device settings
    (``workers.device``, ``workers.dtype``, ``workers.gradient_checkpointing``; offload when
    ``engine.colocated``), so the workers of every strategy get them whoever builds the rest.
    """
    w = cfg.workers
    with_ref = cfg.algorithm.use_kl_loss
    policy_kwargs = {
        **policy_kwargs,
        "off_policy_correction": resolve_correction(
            cfg.algorithm.off_policy_correction, cfg.trainer.strategy
        ),
        "tis_cap": cfg.algorithm.tis_cap,
        "device": w.device,
        "dtype": w.dtype,
        "gradient_checkpointing": w.gradient_checkpointing,
        "offload": cfg.engine.colocated,  # free the GPU for an engine that shares it
    }
    if w.backend == "local":
        workers = await LocalWorkerGroup.create(
            model_dir, policy_kwargs=policy_kwargs, with_ref=with_ref
        )
    else:
        from trainer.workers.ray_group import RayWorkerGroup

        workers = await RayWorkerGroup.create(
            model_dir,
            policy_kwargs=policy_kwargs,
            with_ref=with_ref,
            num_workers=w.num_policy_workers,
            collective_timeout_s=w.collective_timeout_s,
            data_parallel=w.data_parallel,
            gpus_per_worker=w.gpus_per_worker,
        )
    try:
        yield workers
    finally:
        with trio.CancelScope(shield=True):
            await workers.shutdown()


def uses_ray(cfg: Config) -> bool:
    """Whether the run needs a Ray cluster (Ray workers, or engines placed by Ray)."""
    return cfg.workers.backend == "ray" or (
        cfg.engine.backend == "local" and cfg.engine.placement == "ray"
    )


@asynccontextmanager
async def open_ray_cluster(cfg: Config) -> AsyncIterator[None]:
    """Join ``workers.ray_address`` or start a local cluster sized for the run; always leave it.

    Starting is retried on failure only (see ``trainer.workers.ray_cluster``); a cluster this
    run started is stopped at exit, bounded. Entered before the engines and workers, so it
    is left after both are stopped.
    """
    from trainer.workers.ray_cluster import open_cluster

    w, e = cfg.workers, cfg.engine
    cpus = w.num_policy_workers + 1 if w.backend == "ray" else 0
    if e.placement == "ray":
        cpus += math.ceil(e.num_engines * e.ray_num_cpus)
    async with open_cluster(w.ray_address, retries=w.ray_init_retries, num_cpus=cpus):
        yield
