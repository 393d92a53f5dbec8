"""The engines of a run: the servers of ``engine.backend`` (reference, vLLM; processes or
Ray-placed) or an in-process engine, and the client the loop talks to, stopped when the run
leaves (:func:`open_engines`); the vLLM server specs built from the config."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import torch

from engines.client import (
    DATA_PLANE_ROUTES,
    PAUSE_ROUTES,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
    InferenceClient,
)
from engines.devices import resolve_device, resolve_dtype
from engines.launch import (
    EngineProcesses,
    RayEngine,
    ReferenceServers,
    ServersSpec,
    open_engine_processes,
)
from engines.types import EngineClient
from engines.vllm.flags import VLLM_TRANSPORTS
from engines.vllm.inprocess import open_vllm_inprocess_client
from engines.vllm.serve import VllmServers, check_server_config, gpu_groups
from engines.weight_transfer import dtype_name
from sync.registry import TRANSPORTS
from trainer.config import Config
from trainer.errors import ConfigError
from trainer.run._parts import cpu_threads

__all__ = [
    "Engines",
    "open_engine",
    "open_engines",
    "refuse_sleep_on_the_cpu",
    "vllm_servers",
]

log = logging.getLogger("trainer.run")
#: Default of ``engine.startup_timeout_s`` for vLLM engines.
VLLM_STARTUP_TIMEOUT_S = 900.0


@attrs.frozen
class Engines:
    """The run's engines: their client, and the servers the trainer started as processes."""

    client: EngineClient
    #: ``engine.backend=local`` or ``vllm`` with ``placement=process``: the server processes
    #: (restartable); None for every other backend and placement.
    processes: EngineProcesses | None = None


@asynccontextmanager
async def open_engine(cfg: Config, model_dir: Path, run_dir: Path) -> AsyncIterator[EngineClient]:
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


def sleeps_engines(cfg: Config) -> bool:
    """Whether the run sleeps its engines during weight syncs (their servers then need
    sleep mode: ``--enable-sleep-mode``)."""
    return cfg.sync_bracket.sleeps


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
    """The ``vllm serve`` servers of ``engine.backend=vllm`` (see :mod:`engines.vllm.serve`).

    Their ``--dtype`` is :func:`policy_dtype`; ``cpu`` where this process sees no CUDA
    (vLLM's CPU build).
    """
    e = cfg.engine
    transport = cfg.sync.transport
    assert transport in VLLM_TRANSPORTS, "validate_cfg allows only vLLM's backends"
    cpu = not torch.cuda.is_available()
    groups: tuple[tuple[int, ...], ...] = ()
    if e.placement == "process":  # Ray gives its actors their GPUs
        first = 0 if TRANSPORTS[transport].same_gpu else 1
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
) -> EngineProcesses | list[RayEngine]:
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
    # the fork server forks reference servers; `vllm serve` always starts afresh
    fork_server = e.fork_server if e.backend == "local" else None
    if e.placement == "process":
        engines = await stack.enter_async_context(
            open_engine_processes(
                e.num_engines, servers, log_dir, fork_server=fork_server, **started
            )
        )
        return engines
    from engines.launch import open_ray_engines
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
