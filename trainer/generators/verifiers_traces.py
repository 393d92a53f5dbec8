"""From verifiers 0.4 episodes to the trainer's trajectories
(:mod:`trainer.generators.verifiers_env`).

:func:`outcome_of` reads an ``Episode`` (one agent: one trace): per trainable branch its token
ids, sampled mask and logprobs (the prompt included), the trace's reward (the taskset's rewards,
summed), whether it succeeded and each model call's finish reason. :func:`trajectories_of`
makes one trajectory per branch: the prompt is what precedes the first sampled token, the rest
the response, the sampled mask its loss mask, cut at ``max_response_tokens`` (``truncated``).

A **failed** episode (the episode or its trace not ``ok``, no sampled token, or an episode that
raised) is never trained on silently: its trajectory keeps the tokens it has with a loss mask of
zeros (it teaches nothing itself) and the mean reward of its group's episodes that succeeded
(0.0 when none did), so the group's baseline is what the others make it; counted in
``generate/failed_episodes``, the first failure of a step logged with its errors.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from trainer.generators._base import GeneratorInput, GeneratorOutput, Trajectory

__all__ = ["EpisodeOutcome", "outcome_of", "trajectories_of"]

log = logging.getLogger(__name__)

#: ``(token ids, sampled mask, logprobs)`` of one branch, prompt included.
Branch = tuple[list[int], list[bool], list[float]]


@attrs.frozen
class EpisodeOutcome:
    """One verifiers episode as the trainer reads it."""

    #: Each trainable branch of its trace.
    branches: list[Branch]
    reward: float
    ok: bool
    #: Why it failed (``type: message``), empty when ``ok``.
    error: str = ""
    #: Each model call's finish reason, in order (``stop``, ``length``, ...).
    finishes: tuple[str, ...] = ()

    @classmethod
    def raised(cls, exc: BaseException) -> EpisodeOutcome:
        """An episode that raised instead of returning."""
        return cls([], 0.0, False, f"{type(exc).__name__}: {exc}"[:300])


def outcome_of(episode: Any) -> EpisodeOutcome:
    """The trainer's reading of a verifiers ``Episode`` (see the module docstring)."""
    traces = list(episode.traces)
    errors = [e for t in traces for e in t.errors] + list(episode.errors)
    branches = [
        (list(b.token_ids), [bool(m) for m in b.sampled_mask], [float(x) for x in b.logprobs])
        for t in traces[:1]
        for b in t.branches
        if b.trainable
    ]
    ok = bool(episode.ok and traces and traces[0].ok and any(any(m) for _, m, _ in branches))
    reward = float(traces[0].reward) if traces else 0.0
    error = "" if ok else "; ".join(f"{e.type}: {e.message}"[:300] for e in errors[:3])
    finishes = tuple(
        str(c.finish_reason or "abort")
        for t in traces[:1]
        for b in t.branches[-1:]
        for c in b.calls
    )
    return EpisodeOutcome(
        branches, reward, ok, error or ("" if ok else "no sampled tokens"), finishes
    )


def trajectories_of(
    batch: GeneratorInput,
    outcomes: Sequence[EpisodeOutcome],
    *,
    decode: Callable[[list[int]], str],
    max_response_tokens: int,
) -> GeneratorOutput:
    """The step's trajectories, in ``batch``'s order (one per trainable branch), and its
    metrics; ``decode`` makes a response's text from its sampled tokens."""
    by_group: dict[int, list[float]] = {}
    for item, o in zip(batch, outcomes, strict=True):
        if o.ok:
            by_group.setdefault(item.group_id, []).append(o.reward)
    failed = [o for o in outcomes if not o.ok]
    if failed:
        log.warning(
            "%d of %d verifiers episodes failed (trained with loss mask 0); the first: %s",
            len(failed),
            len(outcomes),
            failed[0].error,
        )
    trajectories: list[Trajectory] = []
    for item, o in zip(batch, outcomes, strict=True):
        reward = o.reward if o.ok else statistics.fmean(by_group.get(item.group_id, [0.0]))
        branches = o.branches or [(list(item.prompt_ids), [False] * len(item.prompt_ids), [])]
        for branch in branches:
            trajectories.append(
                _trajectory(branch, o, reward, item.group_id, decode, max_response_tokens)
            )
    return GeneratorOutput(
        trajectories,
        metrics={
            "generate/failed_episodes": float(len(failed)),
            "generate/samples_per_trajectory": len(trajectories) / len(batch),
            "generate/num_turns_mean": statistics.fmean(len(o.finishes) for o in outcomes),
            "generate/truncated_frac": statistics.fmean(
                t.finish_reason == "truncated" for t in trajectories
            ),
        },
    )


def _trajectory(
    branch: Branch,
    o: EpisodeOutcome,
    reward: float,
    group_id: int,
    decode: Callable[[list[int]], str],
    keep: int,
) -> Trajectory:
    ids, mask, logprobs = branch
    start = next((i for i, m in enumerate(mask) if m), len(ids))
    response = ids[start:]
    finish = o.finishes[-1] if o.finishes else "stop"
    if len(response) > keep:
        finish = "truncated"
    sampled = mask[start:]
    return Trajectory(
        prompt_ids=ids[:start],
        response_ids=response[:keep],
        loss_mask=[int(m and o.ok) for m in sampled][:keep],
        reward=reward,
        rollout_logprobs=(logprobs[start:] + [0.0] * len(response))[: len(response)][:keep],
        group_id=group_id,
        finish_reason=finish,
        num_turns=max(len(o.finishes), 1),
        response_text=decode([t for t, m in zip(response[:keep], sampled) if m]),
    )
