"""The synchronous step loop: each stage of DESIGN 4.3 in order, each inside a ``Timer``.

Mechanism (deadlines, brackets, transfers, checkpoint writes) lives elsewhere; this module
only says what happens in a step and in which order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from sync.weights import save_weights_for_sampler
from trainer import stages
from trainer.errors import WeightSyncTimeoutError
from trainer.vocabulary import Timer, step_deadline
from trainer.workers.batch import make_batch

if TYPE_CHECKING:
    from trainer.run import RunContext

__all__ = ["run_step", "sync_weights", "train_loop"]


async def run_step(ctx: RunContext, step: int) -> dict[str, Any]:
    """One step: generate, score, compute advantages, train, maybe checkpoint, sync weights."""
    timings: dict[str, float] = {}
    with Timer("generate", timings):
        prompts = ctx.loader.next_batch()
        rollouts = await ctx.generator.generate(stages.generator_input(ctx, prompts, step))
    with Timer("fwd_logprobs_values_reward", timings):
        batch = make_batch(rollouts.trajectories, ctx.tokenizer.pad_token_id)
        batch.old_logprobs = await ctx.workers.compute_logprobs(batch)
        batch.ref_logprobs = await ctx.workers.compute_ref_logprobs(batch)
        metrics = stages.rollout_metrics(prompts, rollouts)
    with Timer("compute_advantages", timings):
        batch.advantages = stages.advantages_for(ctx, rollouts)
    with Timer("train_critic_and_policy", timings):
        metrics |= await stages.train_policy(
            ctx, batch, [t.group_id for t in rollouts.trajectories]
        )
    if ctx.checkpoint_due(step):
        with Timer("save_checkpoints", timings):
            metrics |= await stages.save_checkpoint(ctx, step)
    with Timer("sync_weights", timings):
        metrics |= await sync_weights(ctx, step)
    return metrics | {f"timing/{k}": v for k, v in timings.items()}


async def sync_weights(ctx: RunContext, step: int) -> dict[str, float]:
    """A weight sync under its own (shorter) budget, ``trainer.weight_sync_timeout_s``."""
    with step_deadline(step, ctx.cfg.trainer.weight_sync_timeout_s, WeightSyncTimeoutError):
        e = ctx.cfg.engine
        result = await save_weights_for_sampler(
            ctx.workers,
            ctx.engine,
            ctx.transport,
            pause_mode=e.pause_mode,
            colocated=e.colocated,
            offload_kv=e.offload_kv_for_weight_sync,
        )
    ctx.weight_version += 1
    return {**result, "sync/weight_version": ctx.weight_version}


async def train_loop(ctx: RunContext, first_step: int, last_step: int) -> list[dict[str, Any]]:
    """Steps ``first_step..last_step``, each under ``trainer.step_timeout_s``; logs each step."""
    history = []
    for step in range(first_step, last_step + 1):
        t0 = time.perf_counter()
        with step_deadline(step, ctx.cfg.trainer.step_timeout_s):
            metrics = await run_step(ctx, step)
        metrics = {
            "step": step,
            **metrics,
            "timing/step": time.perf_counter() - t0,
            **ctx.loop_metrics(),
        }
        ctx.record_step(metrics)
        if ctx.eval_due(step):
            ctx.record_eval(step, await ctx.evaluate())
        history.append(metrics)
    return history
