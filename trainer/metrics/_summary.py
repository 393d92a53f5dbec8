"""What ``summary.json`` says of a run, from its ``metrics.jsonl`` rows: the reward of its first
and last steps, its first and last evals, and the run's totals of every per-step count.

The rows are the record: a resume keeps the rows up to its checkpoint's step
(:func:`~trainer.metrics.restore_metrics`) and appends the steps it runs, so every figure here
is the uninterrupted run's, however often the run was stopped and resumed.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "EVAL_SUMMARY_KEYS",
    "MISMATCH_WORST",
    "RUN_TOTALS",
    "eval_summary",
    "mismatch_summary",
    "reward_summary",
    "run_totals",
]

#: The per-step counts whose run totals ``summary.json`` holds (``totals``): what went wrong
#: and was absorbed (reward calls that timed out or raised, weight syncs sent again, failed
#: agent episodes, mismatch diagnostics past their thresholds) and what a step spent (dynamic
#: sampling's rounds, and the steps where its rounds ran out).
RUN_TOTALS = (
    "mismatch/crossed",
    "reward/timeouts",
    "reward/errors",
    "sync/resends",
    "generate/failed_episodes",
    "generate/trajectory_splits",
    "dynamic_sampling/rounds",
    "dynamic_sampling/exhausted",
)


def run_totals(rows: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """The sum over step rows of each of :data:`RUN_TOTALS` a row has (absent: never counted)."""
    totals: dict[str, float] = {}
    for row in rows:
        for key in RUN_TOTALS:
            value = row.get(key)
            if isinstance(value, int | float):
                totals[key] = totals.get(key, 0.0) + float(value)
    return totals


#: The ``eval/*`` metrics the run's summary keeps for its first and last eval.
EVAL_SUMMARY_KEYS = ("reward_mean", "sampled_reward_mean", "accuracy", "sampled_accuracy")


def eval_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """The first and last eval of a run (``metrics.jsonl`` rows with ``eval/reward_mean``):
    their steps and rewards, for ``summary.json`` and the closing lines."""
    evals = [r for r in rows if "eval/reward_mean" in r]
    if not evals:
        return {}
    out: dict[str, float] = {}
    for which, row in (("first", evals[0]), ("last", evals[-1])):
        out[f"eval/{which}_step"] = float(row["step"])
        for key in EVAL_SUMMARY_KEYS:
            if f"eval/{key}" in row:
                out[f"eval/{which}_{key}"] = row[f"eval/{key}"]
    return out


def reward_summary(rewards: list[float]) -> dict[str, float]:
    """Mean reward of the first and last 20% of steps (at least one step each)."""
    if not rewards:
        return {}
    k = max(1, round(len(rewards) * 0.2))
    first = statistics.fmean(rewards[:k])
    last = statistics.fmean(rewards[-k:])
    return {"reward/first_20pct": first, "reward/last_20pct": last, "steps": float(len(rewards))}


#: The mismatch diagnostics ``summary.json`` summarises (``mismatch``), each with the fold that
#: picks its worst step: the largest logprob gap, the lowest correlation and ESS.
MISMATCH_WORST = {
    "mismatch/logprob_abs_diff_mean": max,
    "mismatch/logprob_abs_diff_max": max,
    "mismatch/prob_pearson": min,
    "mismatch/is_ess": min,
}


def mismatch_summary(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """Each of :data:`MISMATCH_WORST` over the run's step rows: its ``mean`` over the steps that
    report it, its ``worst`` and the ``worst_step`` (the first, on a tie). Empty for a run
    without them (``bypass_mode``)."""
    out: dict[str, dict[str, float]] = {}
    rows = list(rows)
    for key, fold in MISMATCH_WORST.items():
        points = [
            (float(r[key]), int(r["step"])) for r in rows if isinstance(r.get(key), int | float)
        ]
        if not points:
            continue
        worst = fold(v for v, _ in points)
        out[key.removeprefix("mismatch/")] = {
            "mean": statistics.fmean(v for v, _ in points),
            "worst": worst,
            "worst_step": float(next(step for v, step in points if v == worst)),
        }
    return out
