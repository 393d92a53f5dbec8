"""The parts of a run that are started and always stopped: Ray cluster, workers, weight
transport (the engines are :mod:`trainer.run._engines`); the CPU cores they share.

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from engines.models import resolve_model_path
from sync import registry
from sync.transports import InProcessTransport, WeightTransport
from sync.transports.base import TransportSettings
from trainer.algorithms import resolve_loss_agg_mode
from trainer.config import Config
from trainer.off_policy import resolve_correction
from trainer.workers.group import WorkerGroup
from trainer.workers.local import LocalWorkerGroup

__all__ = [
    "CpuThreads",
    "cpu_threads",
    "critic_kwargs",
    "make_transport",
    "open_ray_cluster",
    "open_transport",
    "open_workers",
    "policy_kwargs",
    "uses_ray",
]

log = logging.getLogger("trainer.run")
#: How long closing the weight transport (rank 0 leaving its group) may take.
TRANSPORT_CLOSE_TIMEOUT_S = 30.0


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


def make_transport(cfg: Config, run_dir: Path) -> WeightTransport:
    """``sync.transport``: safetensors files, a gloo/NCCL broadcast group, or CUDA IPC.

    ``engine.backend=inprocess`` hands the tensors over in memory.
    """
    if cfg.engine.backend == "inprocess":
        return InProcessTransport()
    s = cfg.sync
    settings = TransportSettings(
        s.transport,
        s.bucket_size_mb * 2**20,
        run_dir / "weight_sync",
        group_init_timeout_s=s.group_init_timeout_s,
        timeout_s=cfg.workers.collective_timeout_s,
        master_address=s.master_address,
        packed=s.packed is not False,
    )
    return registry.make_transport(settings)


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


def policy_kwargs(cfg: Config) -> dict[str, object]:
    """Every policy worker's keyword arguments, all from ``cfg``, built here only: the
    optimizer (``optim``), the loss (``algorithm``: the policy loss, its clipping and
    aggregation (a ``seq-mean-token-sum-norm`` length of the response budget), KL, the off-policy correction
    for ``trainer.strategy``), the sampling temperature the logprobs are taken at, the micro
    batch, the seed, and the device settings (``workers.*``; offload when ``engine.colocated``).
    """
    o, a, w = cfg.optim, cfg.algorithm, cfg.workers
    return {
        "lr": o.lr,
        "betas": o.betas,
        "weight_decay": o.weight_decay,
        "warmup_steps": o.warmup_steps,
        "max_grad_norm": o.max_grad_norm,
        "temperature": cfg.generator.sampling.temperature,
        "policy_loss": a.policy_loss,
        "clip_ratio_low": a.clip_ratio_low,
        "clip_ratio_high": a.clip_ratio_high,
        "clip_ratio_c": a.clip_ratio_c,
        "loss_agg_mode": resolve_loss_agg_mode(a.policy_loss, a.loss_agg_mode),
        "loss_scale_factor": a.loss_scale_factor or cfg.generator.response_budget,
        "kl_loss_coef": a.kl_loss_coef if a.use_kl_loss else 0.0,
        "kl_loss_type": a.kl_loss_type,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "micro_batch_max_tokens": cfg.trainer.micro_batch_max_tokens,
        "seed": cfg.trainer.seed,
        "off_policy_correction": resolve_correction(a.off_policy_correction, cfg.trainer.strategy),
        "tis_cap": a.tis_cap,
        "device": w.device,
        "dtype": w.dtype,
        "gradient_checkpointing": w.gradient_checkpointing,
        "offload": cfg.engine.colocated,  # free the GPU for an engine that shares it
    }


def critic_kwargs(cfg: Config, model_dir: Path) -> dict[str, object] | None:
    """The critic worker's keyword arguments, all from ``cfg`` (``critic.*``; the micro batch,
    the seed and the device settings as the policy's), built here only; None for a run that
    trains no critic. ``model_dir``: the critic's model, resolved."""
    if not cfg.algorithm.trains_critic:
        return None
    c, o, w = cfg.critic, cfg.critic.optim, cfg.workers
    return {
        "model_dir": str(model_dir),
        "lr": o.lr,
        "betas": o.betas,
        "weight_decay": o.weight_decay,
        "warmup_steps": o.warmup_steps,
        "max_grad_norm": o.max_grad_norm,
        "value_clip": c.value_clip,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "seed": cfg.trainer.seed,
        "device": w.device,
        "dtype": w.dtype,
        "gradient_checkpointing": w.gradient_checkpointing,
    }


@asynccontextmanager
async def open_workers(cfg: Config, model_dir: Path) -> AsyncIterator[WorkerGroup]:
    """The worker group of ``workers.backend``, shut down when the block exits, whatever the error.

    ``ray`` needs the run's Ray cluster connected (:func:`open_ray_cluster`). Each policy
    worker gets :func:`policy_kwargs`; a critic, :func:`critic_kwargs` (its model
    ``critic.model.path``, or ``model_dir``, the policy's).
    """
    w = cfg.workers
    with_ref = cfg.algorithm.use_kl_loss
    kwargs = policy_kwargs(cfg)
    critic_path = cfg.critic.model.path
    critic_dir = (
        model_dir
        if critic_path is None
        else await trio.to_thread.run_sync(resolve_model_path, critic_path)
    )
    critic = critic_kwargs(cfg, critic_dir)
    if w.backend == "local":
        workers = await LocalWorkerGroup.create(
            model_dir, policy_kwargs=kwargs, with_ref=with_ref, critic_kwargs=critic
        )
    else:
        from trainer.workers.ray_group import RayWorkerGroup

        workers = await RayWorkerGroup.create(
            model_dir,
            policy_kwargs=kwargs,
            with_ref=with_ref,
            num_workers=w.num_policy_workers,
            collective_timeout_s=w.collective_timeout_s,
            data_parallel=w.data_parallel,
            gpus_per_worker=w.gpus_per_worker,
            critic_kwargs=critic,
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
