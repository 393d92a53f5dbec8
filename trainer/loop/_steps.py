"""The run's skeleton for either strategy, and the synchronous step: its stages (DESIGN 4.3)
in order.

Each stage is a ``Timer``; each step runs under ``trainer.step_timeout_s`` and the hang
watchdog (``trainer.watchdog``), each weight sync
under ``trainer.weight_sync_timeout_s``, each eval under its own ``trainer.step_timeout_s``.
Mechanism (deadlines, brackets, transfers, checkpoint writes) lives elsewhere; this module
only says what happens and in which order.
"""

from __future__ import annotations

import functools
import time

from sync import weights as weight_sync
from trainer.data import Example
from trainer.errors import WeightSyncTimeoutError
from trainer.generators import GeneratorOutput
from trainer.loop import _stages as stages
from trainer.loop._context import RunContext
from trainer.loop._distillation import distill, teacher_logprobs
from trainer.loop._dynamic_sampling import generate_filtered
from trainer.loop._engine_logs import engine_logs_on_unusable
from trainer.loop._mismatch import batch_mismatch_sums, finish_mismatch
from trainer.vocabulary import Timer, step_deadline

__all__ = [
    "eval_if_due",
    "resync_engines",
    "run_eval",
    "run_step",
    "run_training",
    "sync_weights",
    "train_on",
]


async def run_training(ctx: RunContext) -> None:
    """Sync the policy to the engines, then run steps ``first_step..last_step`` (eval where due),
    each the way ``ctx.strategy`` runs a step, inside what it runs around them (fully-async:
    the rollout tasks).

    The first sync matters on resume: the checkpoint's policy differs from ``model.path``;
    it is the last start-up phase ``ctx.progress`` shows.
    The last step saves a checkpoint when ``trainer.ckpt_interval`` is set.
    With ``ctx.recovery``, a restarted engine is synced by :func:`resync_engines` from here on.
    """
    if ctx.recovery is not None:  # the loop can sync from now: a restart waits until here
        ctx.recovery.set_resync(functools.partial(resync_engines, ctx))
    with ctx.progress.phase("first weight sync"):
        await sync_weights(ctx, ctx.first_step - 1)
    await eval_if_due(ctx, ctx.first_step - 1)
    async with ctx.strategy.steps(ctx) as run_one:
        for step in range(ctx.first_step, ctx.last_step + 1):
            t0 = time.perf_counter()
            with ctx.watching(step), step_deadline(step, ctx.cfg.trainer.step_timeout_s):
                metrics = await run_one(step)
            step_s = time.perf_counter() - t0
            ctx.record_step(
                {
                    "step": step,
                    **metrics,
                    **ctx.strategy.step_metrics(metrics, step_s),
                    "timing/step": step_s,
                    **ctx.loop_metrics(),
                }
            )
            await eval_if_due(ctx, step)


async def run_step(ctx: RunContext, step: int) -> dict[str, object]:
    """One step: generate, score, compute advantages, train, maybe checkpoint, sync weights."""
    timings: dict[str, float] = {}
    if ctx.recovery is not None:
        ctx.recovery.step = step
    with Timer("generate", timings):
        if ctx.cfg.algorithm.dynamic_sampling.type == "filter":
            prompts, rollouts, filtered = await generate_filtered(ctx, step)
        else:
            prompts, filtered = ctx.strategy.loader.next_batch(), {}
            rollouts = await ctx.generator.generate(stages.generator_input(ctx, prompts, step))
    async with ctx.weights_lock:  # a restarted engine's sync waits until the policy is synced
        metrics = filtered | await train_on(ctx, step, prompts, rollouts, timings)
        with Timer("sync_weights", timings):
            metrics |= await sync_weights(ctx, step)
    return metrics | {f"timing/{k}": v for k, v in timings.items()}


async def train_on(
    ctx: RunContext,
    step: int,
    prompts: list[Example],
    rollouts: GeneratorOutput,
    timings: dict[str, float],
) -> dict[str, object]:
    """The stages between rollouts and weight sync, the same in both strategies."""
    with Timer("fwd_logprobs_values_reward", timings):
        batch = stages.make_batch(rollouts.trajectories, ctx.tokenizer.pad_token_id)
        batch.old_logprobs = await stages.old_logprobs_for(ctx, batch)
        metrics: dict[str, object] = {}
        metrics |= batch_mismatch_sums(ctx, batch)  # over every sampled token, before a mask
        metrics |= stages.reject_mismatched(ctx, batch)  # rollout_rs: before the mask is read
        batch.ref_logprobs = await ctx.workers.compute_ref_logprobs(batch)
        batch.values = await ctx.workers.compute_values(batch)  # None without a critic
        metrics |= stages.rollout_metrics(prompts, rollouts)
    teacher = None
    if ctx.teacher is not None:  # algorithm.distillation
        with Timer("teacher_logprobs", timings):
            teacher = await teacher_logprobs(ctx.teacher, rollouts.trajectories)
    with Timer("compute_advantages", timings):
        batch.advantages, batch.returns, more = stages.advantages_for(ctx, rollouts, batch)
        metrics |= more
        if teacher is not None:  # the negative reverse KL, plus the task's share
            batch.advantages, more = distill(ctx, batch, teacher, batch.advantages)
            metrics |= more
    with Timer("train_critic_and_policy", timings):
        metrics |= await stages.train_critic_and_policy(
            ctx, step, batch, [t.group_id for t in rollouts.trajectories]
        )
    metrics |= finish_mismatch(ctx, step, metrics)  # mismatch/*: warns past a threshold
    if ctx.checkpoint_due(step):
        with Timer("save_checkpoints", timings):
            metrics |= await stages.save_checkpoint(ctx, step, metrics)
    return metrics


async def sync_weights(
    ctx: RunContext, step: int, *, new_policy: bool = True, verify: bool = False
) -> dict[str, float]:
    """A weight sync under its own (shorter) budget, ``trainer.weight_sync_timeout_s``.

    ``ctx.versions`` says a sync is under way until its version is counted (rollouts that go
    on meanwhile, fully-async, label their tokens by it: ``trainer.loop._rollout_versions``),
    then that the engines serve trained step ``step``'s policy (``new_policy=False``: the same
    policy again, a restarted engine's sync). With ``ctx.recovery`` the sync reaches the
    engines that are up (``sync_members``). ``verify``: check every engine whatever
    ``sync.verify`` says.
    """
    versions = ctx.versions
    with step_deadline(step, ctx.cfg.trainer.weight_sync_timeout_s, WeightSyncTimeoutError):
        e = ctx.cfg.engine
        versions.syncing = True
        try:

            async def transfer() -> dict[str, float]:
                return await weight_sync.sync_weights(
                    ctx.engine,
                    ctx.workers,
                    ctx.transport,
                    bracket=ctx.cfg.plan.bracket,
                    pause_mode=e.pause_mode,
                    grace_s=ctx.cfg.sync.transfer_grace_s,
                    weight_version=versions.upcoming,  # a restarted or new engine counts from 0
                )

            async with engine_logs_on_unusable(ctx.run_dir):
                with ctx.stalls.window() as stall:
                    # with recovery: to the engines that are up; one failing meanwhile is left out
                    recovery = ctx.recovery
                    result = await (recovery.sync_members(transfer) if recovery else transfer())
            result |= await stages.verify_weights(ctx, step, versions.upcoming, force=verify)
        finally:
            versions.syncing = False
    versions.synced(step if new_policy else None)
    return {**result, "sync/max_stall_ms": stall.max_ms, "sync/weight_version": versions.current}


async def resync_engines(ctx: RunContext) -> None:
    """A restarted engine's way back (``ctx.recovery``, holding ``ctx.weights_lock``): one
    complete weight sync to every engine, each verified against the policy."""
    assert ctx.recovery is not None
    await sync_weights(ctx, ctx.recovery.step, new_policy=False, verify=True)


async def eval_if_due(ctx: RunContext, step: int) -> None:
    """After ``step`` (``first_step - 1``: before the first), when eval is due: run, record."""
    if ctx.eval_due(step):
        with ctx.progress.evaluating(step) as shown:
            shown |= await run_eval(ctx, step)
        ctx.record_eval(step, shown)


async def run_eval(ctx: RunContext, step: int) -> dict[str, float]:
    """Greedy rollouts of the eval prompts: the ``eval`` stage, under ``trainer.step_timeout_s``."""
    timings: dict[str, float] = {}
    with step_deadline(step, ctx.cfg.trainer.step_timeout_s), Timer("eval", timings):
        metrics = await stages.evaluate(ctx, step)
    return metrics | {"timing/eval": timings["eval"]}
