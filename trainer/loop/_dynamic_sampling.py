"""DAPO's dynamic sampling (``algorithm.dynamic_sampling.type=filter``, Yu et al. 2025): a group
whose rewards are all equal has all-zero advantages under a group baseline and teaches nothing,
so a step trains only on *informative* groups, generating more until it holds
``trainer.train_batch_size`` of them, at most ``max_rounds`` batches' worth.

The rewards judged are the :func:`~trainer.loop._stages.shaped_rewards` the advantages read.
Every prompt generated counts as used, so the data position (the loader's, the prompt
stream's) moves past the filtered ones too, and resume stays exact. Metrics per step:
``dynamic_sampling/rounds`` (batches generated; fully-async: groups taken over the batch
size), ``dynamic_sampling/kept_frac`` (informative groups over groups generated) and
``dynamic_sampling/exhausted`` (1 where ``max_rounds`` ran out first).
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Sequence

import attrs

from trainer.data import Example
from trainer.generators import GeneratorOutput, Trajectory
from trainer.loop import _stages as stages
from trainer.loop._context import RunContext

__all__ = ["FilterCount", "generate_filtered", "is_informative"]

log = logging.getLogger(__name__)


def is_informative(ctx: RunContext, trajectories: Sequence[Trajectory]) -> bool:
    """Whether a group's shaped rewards differ (a group of one never does)."""
    rewards, _ = stages.shaped_rewards(ctx, trajectories)
    return bool(rewards.max() != rewards.min())


@attrs.define
class FilterCount:
    """One step's filtering: groups seen and kept, and the rounds it took."""

    batch_size: int
    seen: int = 0
    kept: int = 0

    @property
    def rounds(self) -> int:
        return math.ceil(self.seen / self.batch_size)

    def metrics(self, exhausted: bool) -> dict[str, float]:
        return {
            "dynamic_sampling/rounds": float(self.rounds),
            "dynamic_sampling/kept_frac": self.kept / max(self.seen, 1),
            "dynamic_sampling/exhausted": float(exhausted),
        }


def _groups(out: GeneratorOutput, ids: range) -> list[list[Trajectory]]:
    by_id: dict[int, list[Trajectory]] = {g: [] for g in ids}
    for t in out.trajectories:
        by_id[t.group_id].append(t)
    return [by_id[g] for g in ids]


async def generate_filtered(
    ctx: RunContext, step: int
) -> tuple[list[Example], GeneratorOutput, dict[str, float]]:
    """The synchronous step's rollouts under dynamic sampling: batches of prompts from the
    loader, generated in turn, until ``train_batch_size`` informative groups (the first ones,
    in data order; the rest of the last batch is dropped, as verl does) or ``max_rounds``
    batches. Past ``max_rounds`` the step trains on the informative groups it has, or on the
    last batch's where it has none, and says so in a warning. Groups are numbered 0.. in the
    result; each round's groups get seeds of their own (:func:`stages.generator_input`)."""
    want = ctx.cfg.trainer.train_batch_size
    max_rounds = ctx.cfg.algorithm.dynamic_sampling.max_rounds
    count = FilterCount(want)
    kept: list[tuple[Example, list[Trajectory]]] = []
    outputs: list[GeneratorOutput] = []
    last: list[tuple[Example, list[Trajectory]]] = []
    for round_ in range(max_rounds):
        prompts = ctx.strategy.loader.next_batch()
        first = round_ * want
        out = await ctx.generator.generate(
            stages.generator_input(ctx, prompts, step, first_group=first)
        )
        outputs.append(out)
        last = list(zip(prompts, _groups(out, range(first, first + len(prompts)))))
        for example, group in last:
            count.seen += 1
            if len(kept) < want and is_informative(ctx, group):
                kept.append((example, group))
        count.kept = len(kept)
        if len(kept) >= want:
            break
    exhausted = len(kept) < want
    if exhausted:
        log.warning(
            "step %d: dynamic sampling found %d of %d informative groups in %d rounds "
            "(algorithm.dynamic_sampling.max_rounds); training on %s",
            step,
            len(kept),
            want,
            max_rounds,
            "those" if kept else "the last round's groups, which teach nothing",
        )
    chosen = kept or last
    trajectories = []
    for g, (_, group) in enumerate(chosen):
        for t in group:
            t.group_id = g
            trajectories.append(t)
    keys = sorted({k for o in outputs for k in o.metrics})
    metrics = {k: statistics.fmean(o.metrics[k] for o in outputs if k in o.metrics) for k in keys}
    return (
        [ex for ex, _ in chosen],
        GeneratorOutput(trajectories, metrics),
        count.metrics(exhausted),
    )
