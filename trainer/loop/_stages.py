"""The mechanism behind each stage of the step, so that ``loop.py`` reads on one screen."""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from math import fsum
from typing import Any

import torch

from sync.verify import verify_sync
from trainer.algorithms import (
    MISMATCH_SUMS,
    compute_advantages,
    explained_variance,
    gae_advantages_and_returns,
    masked_mean,
    overlong_penalty,
)
from trainer.data import Example
from trainer.generators import GeneratorInput, GeneratorOutput, Trajectory, TrajectoryInput
from trainer.generators.chat import render_prompt
from trainer.loop._context import RunContext
from trainer.loop._kl_in_reward import STATE_KEY as KL_CTRL_STATE_KEY
from trainer.loop._kl_in_reward import kl_token_rewards
from trainer.metrics import jsonable_row
from trainer.off_policy import rejection_mask
from trainer.workers.batch import TrainBatch
from trainer.workers.training import extreme

__all__ = [
    "advantages_for",
    "evaluate",
    "generator_input",
    "group_inputs",
    "make_batch",
    "old_logprobs_for",
    "reject_mismatched",
    "rollout_metrics",
    "save_checkpoint",
    "shaped_rewards",
    "train_critic_and_policy",
    "trajectory_seed",
    "verify_weights",
]


def trajectory_seed(seed: int, step: int, group_id: int) -> int:
    """The sampling seed of the first sample of group ``group_id`` at ``step`` (run ``seed``),
    under ``trainer.strategy=sync``; the group's samples count up from it."""
    return (seed * 1_000_003 + step * 10_007 + group_id * 101) % (2**62)


def group_inputs(
    ctx: RunContext, example: Example, group_id: int, n: int, *, ids: str, first_seed: int
) -> list[TrajectoryInput]:
    """The ``n`` trajectories of one prompt: one group, for any strategy.

    The prompt is rendered once (:func:`trainer.generators.chat.render_prompt`: a string is
    tokenized, chat messages go through the chat template); each trajectory gets its own copy
    of the example's ``extra`` and messages, the id ``{ids}-{s}`` and the seed
    ``first_seed + s``: the seeds of a group count up by one, which is what
    ``engine.generate_n`` samples in one request (``shared_first_turns`` relies on it). The
    caller decides ``ids`` and ``first_seed``, once. Blocking only as long as one
    tokenization: call it on the loop.
    """
    text, prompt_ids = render_prompt(ctx.tokenizer, example.prompt)
    messages = None if isinstance(example.prompt, str) else example.prompt
    return [
        TrajectoryInput(
            prompt=text,
            prompt_ids=prompt_ids,
            answer=example.answer,
            group_id=group_id,
            trajectory_id=f"{ids}-{s}",
            seed=(first_seed + s) % (2**62),
            extra=dict(example.extra),
            messages=None if messages is None else [dict(m) for m in messages],
        )
        for s in range(n)
    ]


def generator_input(
    ctx: RunContext, prompts: list[Example], step: int, n: int | None = None, first_group: int = 0
) -> GeneratorInput:
    """Each prompt ``n`` times (default ``n_samples_per_prompt``): :func:`group_inputs` per
    prompt, ids ``step-group-sample``, seeds from :func:`trajectory_seed`; the groups are
    numbered from ``first_group`` (a step's later dynamic-sampling rounds continue the count,
    so that no two groups of a step share seeds)."""
    n = n or ctx.cfg.generator.n_samples_per_prompt
    seed = ctx.cfg.trainer.seed
    items = [
        item
        for g, ex in enumerate(prompts, start=first_group)
        for item in group_inputs(
            ctx, ex, g, n, ids=f"{step}-{g}", first_seed=trajectory_seed(seed, step, g)
        )
    ]
    return GeneratorInput(tuple(items), global_step=step, weight_version=ctx.versions.current)


def make_batch(trajectories: Sequence[Trajectory], pad_token_id: int) -> TrainBatch:
    """Pad ``prompt + response`` of each trajectory to a common length.

    Token-level tensors are shifted by one (position ``t`` predicts token ``t + 1``):
    ``loss_mask`` and ``rollout_logprobs`` (the engine's logprobs, ``0.0`` wherever the loss
    mask is 0: environment tokens, prompt, padding) line up with the logprobs the workers
    compute.
    """
    seqs = [t.prompt_ids + t.response_ids for t in trajectories]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.float32)
    rollout = torch.zeros((len(seqs), width), dtype=torch.float32)
    for i, (t, s) in enumerate(zip(trajectories, seqs)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        attn[i, : len(s)] = 1
        p = len(t.prompt_ids)
        mask[i, p : p + len(t.response_ids)] = torch.tensor(t.loss_mask, dtype=torch.float32)
        rollout[i, p : p + len(t.response_ids)] = torch.tensor(
            t.rollout_logprobs, dtype=torch.float32
        )
    rollout = torch.where(mask != 0, rollout, torch.zeros(()))
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask[:, 1:].contiguous(),
        rollout_logprobs=rollout[:, 1:].contiguous(),
    )


async def old_logprobs_for(ctx: RunContext, batch: TrainBatch) -> torch.Tensor | None:
    """The old policy's logprobs of ``batch`` as the plan says: recomputed by the policy,
    the rollout's own (``algorithm.rollout_correction.bypass_mode``), or None (one update per
    batch: the update's own forward has them)."""
    plan = ctx.cfg.plan
    if plan.correction.bypass_mode:
        return batch.rollout_logprobs
    if plan.recomputes_old_logprobs:
        return await ctx.workers.compute_logprobs(batch)
    return None


def reject_mismatched(ctx: RunContext, batch: TrainBatch) -> dict[str, float]:
    """``algorithm.rollout_correction.rollout_rs``: drop from ``batch.loss_mask`` the tokens (or
    sequences) whose old-over-rollout ratio is out of bounds, before anything reads the mask
    (advantages, counts, losses), as verl does; the mask's ``policy/rs_*`` metrics. A no-op
    without a mask."""
    correction = ctx.cfg.plan.correction
    if correction.rollout_rs is None:
        return {}
    assert batch.old_logprobs is not None and batch.rollout_logprobs is not None
    batch.loss_mask, metrics = rejection_mask(
        batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask, correction
    )
    return {f"policy/{k}": v for k, v in metrics.items()}


def accuracy(rewards: Sequence[float]) -> float:
    """The fraction of replies paid in full (reward at least 1.0): a 0-1 reward's exact
    answers, which a partial-credit scorer's mean does not show (``*/accuracy`` metrics)."""
    return statistics.fmean(r >= 1.0 for r in rewards)


def rollout_metrics(prompts: list[Example], out: GeneratorOutput) -> dict[str, Any]:
    """Reward and length statistics, plus which examples the step used (its data order)."""
    rewards = [t.reward for t in out.trajectories]
    return {
        "data/example_index": [ex.index for ex in prompts],
        "reward/mean": statistics.fmean(rewards),
        "reward/accuracy": accuracy(rewards),
        "reward/std": statistics.pstdev(rewards),
        "reward/max": max(rewards),
        "response_length/mean": statistics.fmean(sum(t.loss_mask) for t in out.trajectories),
        **out.metrics,
    }


def shaped_rewards(
    ctx: RunContext, trajectories: Sequence[Trajectory]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The rewards the advantages (and the dynamic-sampling filter) read: the trajectories'
    own, plus ``algorithm.overlong_buffer``'s punishment when it is on (with its metrics:
    ``overlong_buffer/penalty_mean``, ``/punished_frac``)."""
    a = ctx.cfg.algorithm
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    if not a.overlong_buffer.len:
        return rewards, {}
    lengths = torch.tensor([len(t.response_ids) for t in trajectories])
    budget = ctx.cfg.generator.response_budget
    penalty = overlong_penalty(lengths, budget, a.overlong_buffer.len, a.overlong_buffer.penalty)
    return rewards.double() + penalty, {
        "overlong_buffer/penalty_mean": float(penalty.mean()),
        "overlong_buffer/punished_frac": float((penalty < 0).double().mean()),
    }


def advantages_for(
    ctx: RunContext, out: GeneratorOutput, batch: TrainBatch
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The batch's advantages by ``algorithm.advantage_estimator`` (``[B]`` or per token, like
    ``batch.loss_mask``) from the :func:`shaped_rewards` and, with ``use_kl_in_reward``, the
    KL's token-level rewards (:mod:`trainer.loop._kl_in_reward`), the critic's targets where
    the run has a critic (``batch.values`` set: GAE's returns, else None), and the metrics:
    the shaping's, the KL's ``reward/kl_penalty`` and ``reward/kl_coef``, and the critic's
    ``critic/values_mean``, ``critic/returns_mean`` and ``critic/vf_explained_var`` (of the
    values the batch was scored with)."""
    a = ctx.cfg.algorithm
    rewards, metrics = shaped_rewards(ctx, out.trajectories)
    token_rewards, kl_metrics = kl_token_rewards(ctx.cfg, ctx.kl_ctrl, batch)
    metrics |= kl_metrics
    advantages = compute_advantages(
        rewards,
        [t.group_id for t in out.trajectories],
        a.advantage_estimator,
        mask=batch.loss_mask,
        norm_by_std=a.norm_adv_by_std,
        gamma=a.gamma,
        values=batch.values,
        lam=a.lam,
        token_rewards=token_rewards,
    )
    returns = None
    if batch.values is not None:
        mask = batch.loss_mask != 0
        values = batch.values.double()
        _, returns = gae_advantages_and_returns(
            rewards.double(), values, mask, a.gamma, a.lam, token_rewards
        )
        metrics |= {
            "critic/values_mean": float(masked_mean(values, mask)),
            "critic/returns_mean": float(masked_mean(returns, mask)),
            "critic/vf_explained_var": explained_variance(values, returns, mask),
        }
        returns = returns.float()
    return advantages.float(), returns, metrics


async def train_critic_and_policy(
    ctx: RunContext, step: int, batch: TrainBatch, group_ids: list[int]
) -> dict[str, float]:
    """``update_epochs`` passes over the batch in mini-batches of whole prompt groups: each
    mini-batch trains the critic (a run with one), then the policy, unless ``step`` is within
    ``critic.warmup_steps`` (the policy waits for the critic's values to mean something). The
    policy's passes run between ``backload_to_gpu`` and ``offload_to_cpu`` (their bytes join
    the metrics); the metrics are each mini-batch's, averaged (extremes by max or min)."""
    t = ctx.cfg.trainer
    critic = batch.values is not None
    policy = not (critic and step <= ctx.cfg.critic.warmup_steps)
    prompts_per_mini = t.policy_mini_batch_size or t.train_batch_size
    groups = sorted(set(group_ids))
    metrics: dict[str, list[float]] = {}
    moved = await ctx.workers.backload_to_gpu() if policy else {}
    for _epoch in range(t.update_epochs):
        for start in range(0, len(groups), prompts_per_mini):
            chosen = set(groups[start : start + prompts_per_mini])
            rows = [i for i, g in enumerate(group_ids) if g in chosen]
            mini = batch.select(rows)
            step_metrics: dict[str, float] = {}
            if critic:
                step_metrics |= await ctx.workers.critic_forward_backward(mini, mini.counts)
                step_metrics |= await ctx.workers.critic_optim_step()
            if policy:
                step_metrics |= await ctx.workers.forward_backward(mini, mini.counts)
                step_metrics |= await ctx.workers.optim_step()
            for k, v in step_metrics.items():
                metrics.setdefault(k, []).append(v)
    if policy:
        moved |= await ctx.workers.offload_to_cpu()
    return {k: _fold_mini_batches(k)(v) for k, v in metrics.items()} | moved


def _fold_mini_batches(key: str) -> Callable[[list[float]], float]:
    """How a metric folds over a step's mini-batches and epochs: extremes by max or min, the
    mismatch diagnostics' sums (only a step of one update has them) by sum, others by mean."""
    return extreme(key) or (fsum if key in MISMATCH_SUMS else statistics.fmean)


async def save_checkpoint(ctx: RunContext, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
    """Write ``checkpoints/global_step_N`` atomically (in a thread), then the ``latest`` pointer.

    The trainer state holds the data position, the weight version, the engines' restarts so
    far, the KL in the reward's coefficient (``kl_ctrl``) and ``metrics``, the step's metrics so far: a run killed after the save but before the
    step's line reached ``metrics.jsonl`` gets the line back on resume (``restore_metrics``).

    ``checkpoint/max_stall_ms`` is the event loop's longest stall while the save ran: the
    writes happen off the trio thread, so it stays in the milliseconds however long the
    save takes.
    """
    # the checkpoint manager records the step itself (trainer_state.json's "step")
    state = {
        "loader": ctx.data_state(),
        "weight_version": ctx.versions.current,
        "metrics": jsonable_row({"step": step, **metrics}),
    }
    if ctx.recovery is not None:  # the restarts so far, counted on by a resume
        state["engine_recovery"] = ctx.recovery.state_dict()
    if ctx.kl_ctrl is not None:  # an adaptive coefficient goes on from here on resume
        state[KL_CTRL_STATE_KEY] = ctx.kl_ctrl.state_dict()
    with ctx.stalls.window() as stalls:
        path = await ctx.workers.save_checkpoint(ctx.ckpt.save, step, state)
    return {
        "checkpoint/step": step,
        "checkpoint/path": str(path),
        "checkpoint/max_stall_ms": stalls.max_ms,
    }


async def evaluate(ctx: RunContext, step: int) -> dict[str, float]:
    """Greedy rollouts of every eval prompt, once each: the mean reward and the
    :func:`accuracy`; with ``trainer.eval_n_samples_per_prompt``, also that many sampled ones
    (the training sampling, on the engines directly): theirs."""
    assert ctx.eval_generator is not None
    out = await ctx.eval_generator.generate(generator_input(ctx, ctx.eval_examples, step, n=1))
    rewards = [t.reward for t in out.trajectories]
    metrics = {
        "eval/reward_mean": statistics.fmean(rewards),
        "eval/accuracy": accuracy(rewards),
        "eval/num_prompts": float(len(rewards)),
    }
    n = ctx.cfg.trainer.eval_n_samples_per_prompt
    if n:
        assert ctx.eval_sampled_generator is not None
        sampled = await ctx.eval_sampled_generator.generate(
            generator_input(ctx, ctx.eval_examples, step, n=n)
        )
        rewards = [t.reward for t in sampled.trajectories]
        metrics["eval/sampled_reward_mean"] = statistics.fmean(rewards)
        metrics["eval/sampled_accuracy"] = accuracy(rewards)
    return metrics


#: The probe's prompt: fixed token ids any vocabulary has (``sync.verify``).
PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
_log = logging.getLogger("trainer.run")


async def verify_weights(
    ctx: RunContext, step: int, weight_version: int, *, force: bool = False
) -> dict[str, float]:
    """``sync.verify``: after the sync of ``step`` (``first``: the process's first sync), each
    engine against the policy (:func:`sync.verify.verify_sync`); {} when not due. ``force``:
    due whatever ``sync.verify`` says (a restarted engine's sync)."""
    cfg = ctx.cfg
    due = (
        force
        or cfg.sync.verify == "every"
        or (cfg.sync.verify == "first" and step < ctx.first_step)
    )
    if not due:
        return {}
    if cfg.plan.sharded:
        _log.info("sync.verify skipped: the policy is sharded over its Ray workers")
        return {}
    return await verify_sync(
        ctx.engine,
        ctx.workers,
        PROBE_PROMPT,
        tolerance=cfg.plan.verify_tolerance,
        weight_version=weight_version,
    )
