"""The parts of a run that are started and always stopped: Ray cluster, workers, weight
transport (the engines are :mod:`trainer.run._engines`), each as the run plan has it.

Each is an async context manager that :func:`trainer.run._train.train` enters in this order
(cluster, engines, workers, weight transport) and so leaves in reverse, whatever the
error: transport closed, workers shut down, engines stopped, the Ray cluster left (stopped
when the run started it). Modules that import Ray are imported only by runs that use it
(importing Ray costs seconds), hence the imports inside functions below.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from engines.models import resolve_model_path
from sync import registry
from sync.transports import InProcessTransport, LoraAdapterTransport, WeightTransport
from sync.transports.base import TransportSettings
from trainer.algorithms import resolve_loss_agg_mode
from trainer.config import Config, EngineBackend, EnginePlacement, WorkerBackend, loss_options
from trainer.workers.group import WorkerGroup
from trainer.workers.local import LocalWorkerGroup
from trainer.workers.lora import LoraSpec

__all__ = [
    "critic_kwargs",
    "make_transport",
    "open_ray_cluster",
    "open_transport",
    "open_workers",
    "policy_kwargs",
]

log = logging.getLogger("trainer.run")
#: How long closing the weight transport (rank 0 leaving its group) may take.
TRANSPORT_CLOSE_TIMEOUT_S = 30.0


def make_transport(cfg: Config, run_dir: Path) -> WeightTransport:
    """``sync.transport``: safetensors files, a gloo/NCCL broadcast group, or CUDA IPC.

    ``engine.backend=inprocess`` hands the tensors over in memory.
    """
    plan = cfg.plan
    if plan.served_adapter is not None:  # sync.lora=adapter: the adapter, not the weights
        return LoraAdapterTransport(run_dir / "weight_sync", plan.served_adapter.name)
    if plan.engine_backend is EngineBackend.INPROCESS:
        return InProcessTransport()
    s = cfg.sync
    settings = TransportSettings(
        plan.transport.name,
        s.bucket_size_mb * 2**20,
        run_dir / "weight_sync",
        group_init_timeout_s=plan.timeouts.group_init_s,
        timeout_s=plan.timeouts.collective_s,
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
    aggregation (a ``seq-mean-token-sum-norm`` length of the response budget), its own
    parameters (``algorithm.clip_cov``/``kl_cov``/``dro``), KL, the entropy bonus, the rollout correction
    the plan decided), the sampling temperature the logprobs are taken at, the micro
    batch, the seed, the device settings (``workers.*``; offload when ``engine.colocated``) and
    the LoRA adapter (``model.lora``).
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
        "loss_options": loss_options(a),
        "loss_scale_factor": a.loss_scale_factor or cfg.generator.response_budget,
        "kl_loss_coef": a.kl_loss_coef if a.use_kl_loss else 0.0,
        "kl_loss_type": a.kl_loss_type,
        "entropy_coeff": a.entropy_coeff,
        "micro_batch_size": cfg.trainer.micro_batch_size,
        "micro_batch_max_tokens": cfg.trainer.micro_batch_max_tokens,
        "seed": cfg.trainer.seed,
        "rollout_correction": cfg.plan.correction,
        "device": cfg.plan.policy.device,
        "dtype": cfg.plan.policy.dtype,
        "gradient_checkpointing": w.gradient_checkpointing,
        "offload": cfg.engine.colocated,  # free the GPU for an engine that shares it
        "lora": _lora_spec(cfg),
    }


def _lora_spec(cfg: Config) -> LoraSpec | None:
    """The adapter the policy trains (``model.lora``), and whether the engines get it merged;
    None: full fine-tuning."""
    lora = cfg.model.lora
    if not lora.enabled:
        return None
    merged = cfg.plan.served_adapter is None
    return LoraSpec(lora.rank, lora.alpha, lora.dropout, tuple(lora.target_modules), merged)


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
        "device": cfg.plan.policy.device,
        "dtype": cfg.plan.policy.dtype,
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
    with_ref = cfg.plan.uses_reference_model
    kwargs = policy_kwargs(cfg)
    critic_path = cfg.critic.model.path
    critic_dir = (
        model_dir
        if critic_path is None
        else await trio.to_thread.run_sync(resolve_model_path, critic_path)
    )
    critic = critic_kwargs(cfg, critic_dir)
    if cfg.plan.worker_backend is WorkerBackend.LOCAL:
        threads = cfg.plan.threads
        workers = await LocalWorkerGroup.create(
            model_dir,
            policy_kwargs=kwargs,
            with_ref=with_ref,
            critic_kwargs=critic,
            threads=None if threads is None else threads.trainer,
        )
    else:
        from trainer.workers.ray_group import RayWorkerGroup

        workers = await RayWorkerGroup.create(
            model_dir,
            policy_kwargs=kwargs,
            with_ref=with_ref,
            num_workers=w.num_policy_workers,
            collective_timeout_s=cfg.plan.timeouts.collective_s,
            sharded=cfg.plan.sharded,
            gpus_per_worker=w.gpus_per_worker,
            critic_kwargs=critic,
        )
    try:
        yield workers
    finally:
        with trio.CancelScope(shield=True):
            await workers.shutdown()


@asynccontextmanager
async def open_ray_cluster(cfg: Config) -> AsyncIterator[None]:
    """Join ``workers.ray_address`` or start a local cluster sized for the run; always leave it.

    Starting is retried on failure only (see ``trainer.workers.ray_cluster``); a cluster this
    run started is stopped at exit, bounded. Entered before the engines and workers, so it
    is left after both are stopped.
    """
    from trainer.workers.ray_cluster import open_cluster

    w, e, plan = cfg.workers, cfg.engine, cfg.plan
    cpus = w.num_policy_workers + 1 if plan.worker_backend is WorkerBackend.RAY else 0
    if plan.engine_placement is EnginePlacement.RAY:
        cpus += math.ceil(e.num_engines * e.ray_num_cpus)
    async with open_cluster(w.ray_address, retries=w.ray_init_retries, num_cpus=cpus):
        yield
