"""The engines of a run: the servers of ``engine.backend`` (reference, vLLM; processes or
Ray-placed) or an in-process engine, and the client the loop talks to, stopped when the run
leaves (:func:`open_engines`); the vLLM server specs built from the config."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import attrs
import trio

from engines.client import (
    DATA_PLANE_ROUTES,
    LORA_ROUTES,
    PAUSE_ROUTES,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
    InferenceClient,
)
from engines.launch import (
    WEIGHT_DIR_ENV,
    WEIGHT_SYNC_HOSTS_ENV,
    EngineProcesses,
    RayEngine,
    ReferenceServers,
    ServersSpec,
    new_api_key,
    open_engine_processes,
)
from engines.types import EngineClient
from engines.vllm.flags import VllmSettings
from engines.vllm.inprocess import open_vllm_inprocess_client
from engines.vllm.serve import VllmServers, check_server_config, gpu_groups
from trainer.config import ROLLOUT_LOGPROBS_MODE, Config, EngineBackend, EnginePlacement

__all__ = [
    "Engines",
    "open_engine",
    "open_engines",
    "vllm_servers",
    "vllm_settings",
    "weight_sync_hosts",
]

log = logging.getLogger("trainer.run")


@attrs.frozen
class Engines:
    """The run's engines: their client, and the servers the trainer started as processes."""

    client: EngineClient
    #: ``engine.backend=local`` or ``vllm`` with ``placement=process``: the server processes
    #: (restartable); None for every other backend and placement.
    processes: EngineProcesses | None = None
    #: The secret the servers ask for (``Authorization: Bearer``): for servers the trainer
    #: started, ``engine.api_key`` or else the fresh one of this run; for ``remote``,
    #: ``engine.api_key``; None for in-process engines (no HTTP).
    api_key: str | None = None
    #: One line per server the trainer started: its name, process id (its process group's:
    #: ``kill -- -PID`` takes what it started along), URL and log, as the console shows them.
    started: tuple[str, ...] = ()


@asynccontextmanager
async def open_engine(cfg: Config, model_dir: Path, run_dir: Path) -> AsyncIterator[EngineClient]:
    """:func:`open_engines`' client."""
    async with open_engines(cfg, model_dir, run_dir) as engines:
        yield engines.client


@asynccontextmanager
async def open_engines(cfg: Config, model_dir: Path, run_dir: Path) -> AsyncIterator[Engines]:
    """The engines of ``engine.backend`` and their client, as the run plan has them.

    Servers the trainer starts are stopped when the block exits, whatever the error; they ask
    for ``engine.api_key``, or else for a secret made fresh for this run (in their
    environment, never on a command line or in a file), which the client sends. Every
    server is probed for the routes the run uses (naming the ``vllm serve`` flag behind a
    missing one); a vLLM server's config must have the run's weight-transfer backend.
    """
    e, plan = cfg.engine, cfg.plan
    sleeps = plan.bracket.sleeps
    adapter = plan.served_adapter  # sync.lora=adapter: loaded by route, served by name
    sync_routes = LORA_ROUTES if adapter is not None else WEIGHT_TRANSFER_ROUTES
    routes = (*DATA_PLANE_ROUTES, *PAUSE_ROUTES, *sync_routes)
    routes = (*routes, *SLEEP_ROUTES) if sleeps else routes
    if plan.engine_backend is EngineBackend.VLLM_INPROCESS:
        async with open_vllm_inprocess_client(
            vllm_settings(cfg, model_dir),
            control_plane_timeout_s=plan.timeouts.control_plane_s,
            startup_timeout_s=plan.timeouts.engine_startup_s,
            model=adapter.name if adapter is not None else None,
            run_env={
                WEIGHT_DIR_ENV: str(run_dir / "weight_sync"),  # make_transport's folder
                WEIGHT_SYNC_HOSTS_ENV: ",".join(await weight_sync_hosts(cfg)),
            },
        ) as client:
            await client.probe(routes)
            yield Engines(client)
        return
    if plan.engine_backend is EngineBackend.INPROCESS:
        from engines.local.inprocess import open_inprocess_client

        async with open_inprocess_client(
            model_dir, seed=cfg.trainer.seed, device=plan.engine_devices[0]
        ) as client:
            yield Engines(client)
        return
    async with AsyncExitStack() as stack:
        processes, api_key, lines = None, e.api_key, ()
        if plan.engine_backend is EngineBackend.REMOTE:
            urls = list(e.urls)
        else:
            started, api_key = await _start_servers(stack, cfg, model_dir, run_dir)
            urls = [engine.url for engine in started]
            processes = started if isinstance(started, EngineProcesses) else None
            lines = _started_lines(started)
        client = await stack.enter_async_context(
            InferenceClient(
                urls,
                api_key=api_key,
                max_concurrency=e.max_concurrency,
                control_plane_timeout_s=plan.timeouts.control_plane_s,
                model=adapter.name if adapter is not None else None,
            )
        )
        await client.probe(routes)
        if adapter is None:  # the weight-transfer backend the run's transport speaks
            await check_server_config(client, plan.transport.name, needs_sleep=sleeps)
        yield Engines(client, processes, api_key, lines)


def _started_lines(started: EngineProcesses | list[RayEngine]) -> tuple[str, ...]:
    """:attr:`Engines.started` of the servers ``_start_servers`` started."""
    if isinstance(started, EngineProcesses):
        return tuple(f"engine-{p.index}: pid {p.pid}, {p.url}, log {p.log_path}" for p in started)
    return tuple(
        f"engine-{i}: pid {p.pid} on {p.node_ip}, {p.url}, log {p.log_path} (on that node)"
        for i, p in enumerate(started)
    )


def vllm_settings(cfg: Config, model_dir: Path) -> VllmSettings:
    """The run plan's vLLM settings for the model at ``model_dir``."""
    assert cfg.plan.vllm is not None, "the plan has vLLM settings for engine.backend=vllm*"
    return attrs.evolve(cfg.plan.vllm, model=str(model_dir))


def vllm_servers(cfg: Config, model_dir: Path) -> VllmServers:
    """The ``vllm serve`` servers of ``engine.backend=vllm`` (see :mod:`engines.vllm.serve`):
    the plan's settings; with ``placement=process``, each server's GPUs (Ray gives its actors
    theirs)."""
    e = cfg.engine
    groups: tuple[tuple[int, ...], ...] = ()
    if cfg.plan.engine_placement is EnginePlacement.PROCESS:
        first = 0 if cfg.plan.transport.same_gpu else 1
        groups = gpu_groups(e.gpu_ids, e.num_engines, e.tensor_parallel_size, first)
    return VllmServers(vllm_settings(cfg, model_dir), gpu_groups=groups)


async def weight_sync_hosts(cfg: Config) -> tuple[str, ...]:
    """Where policy rank 0 may host the run's weight-sync group, as its servers are told
    (``TRAINER_WEIGHT_SYNC_HOSTS``: an ``init_info`` naming another ``master_address`` is
    refused): ``sync.master_address`` when set; else, where Ray runs in this process, every
    live node of the cluster (rank 0 hosts at its node's address, which is known only once
    the workers exist); else loopback (servers on this machine, reached at ``127.0.0.1``).
    """
    if cfg.sync.master_address is not None:
        return (cfg.sync.master_address,)
    if not cfg.plan.uses_ray:
        return ("127.0.0.1",)

    def node_addresses() -> tuple[str, ...]:
        import ray  # importing Ray costs seconds: in the thread, only where the run uses it

        nodes = ray.nodes() if ray.is_initialized() else []  # a GCS round-trip: off the loop
        return tuple(dict.fromkeys(str(n["NodeManagerAddress"]) for n in nodes if n["Alive"]))

    return await trio.to_thread.run_sync(node_addresses) or ("127.0.0.1",)


async def _start_servers(
    stack: AsyncExitStack, cfg: Config, model_dir: Path, run_dir: Path
) -> tuple[EngineProcesses | list[RayEngine], str]:
    """Start the servers of ``engine.backend`` (stopped when ``stack`` closes): the processes
    (placement=process) or the Ray-placed servers, each with its ``url``, and the secret they
    ask for (``engine.api_key``, or a fresh one). They log under ``RUN_DIR/engines``; a disk
    update may read ``RUN_DIR/weight_sync`` alone (the transport's folder, see
    ``make_transport``)."""
    e, plan = cfg.engine, cfg.plan
    log_dir = run_dir / "engines"
    servers: ServersSpec
    if plan.engine_backend is EngineBackend.VLLM:
        servers = vllm_servers(cfg, model_dir)
    else:
        servers = ReferenceServers(
            str(model_dir),
            cfg.trainer.seed,
            devices=plan.engine_devices,
            enable_sleep_mode=plan.bracket.sleeps,
            num_threads=None if plan.threads is None else plan.threads.server,
            max_lora_rank=plan.served_adapter.max_rank if plan.served_adapter else None,
            logprobs_mode=ROLLOUT_LOGPROBS_MODE,
        )
    api_key = new_api_key() if e.api_key is None else e.api_key
    weight_dir = run_dir / "weight_sync"  # make_transport's folder
    hosts = await weight_sync_hosts(cfg)
    startup_s = plan.timeouts.engine_startup_s
    # the fork server forks reference servers; `vllm serve` always starts afresh
    fork_server = e.fork_server if plan.engine_backend is EngineBackend.LOCAL else None
    if plan.engine_placement is EnginePlacement.PROCESS:
        engines = await stack.enter_async_context(
            open_engine_processes(
                e.num_engines,
                servers,
                log_dir,
                api_key=api_key,
                startup_timeout_s=startup_s,
                fork_server=fork_server,
                weight_dir=weight_dir,
                weight_sync_hosts=hosts,
            )
        )
        return engines, api_key
    from engines.launch import open_ray_engines
    from trainer.workers.ray_cluster import actor_env

    gpus = e.tensor_parallel_size if plan.engine_backend is EngineBackend.VLLM else 0
    placed = await stack.enter_async_context(
        open_ray_engines(
            e.num_engines,
            servers,
            log_dir,
            num_cpus=e.ray_num_cpus,
            num_gpus=gpus,
            env=actor_env(),
            api_key=api_key,
            startup_timeout_s=startup_s,
            weight_dir=weight_dir,
            weight_sync_hosts=hosts,
        )
    )
    log.info("ray engines up: %s", {p.url: (p.node_ip, p.pid) for p in placed})
    return placed, api_key
