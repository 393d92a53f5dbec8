"""The step's mismatch diagnostics (``mismatch/*``, :mod:`trainer.algorithms._mismatch`): made
over the whole step's trained tokens, and a console warning where one crosses its threshold
(``algorithm.mismatch.*``).

Where both logprobs are known decides where the sums are taken:

- the loop recomputes the old logprobs (several updates per batch, or a rejection mask): over
  the whole batch, before a mask drops anything (:func:`batch_mismatch_sums`);
- one update per batch: the update's own forward is the old policy, so the policy worker sums
  each micro-batch as it goes, the ranks' sums add up, and the loop finishes them;
- ``bypass_mode``: the rollout's logprobs *are* the old ones and nothing recomputes them, so
  there is nothing to compare (no ``mismatch/*``; ``policy/ratio_*`` is the gap the PPO clip
  sees).

The warnings go through the ``trainer.mismatch`` logger with one template per diagnostic, so a
mismatch of every step is counted on the console (:class:`~trainer.metrics.RepeatedWarnings`),
not repeated; ``mismatch/crossed`` counts the diagnostics past their threshold in the step
(``summary.json``'s ``totals``).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Mapping

import attrs

from trainer.algorithms import MISMATCH_SUMS, mismatch_metrics, mismatch_sums
from trainer.loop._context import RunContext
from trainer.workers.batch import TrainBatch

__all__ = ["SUSPECTS", "batch_mismatch_sums", "finish_mismatch", "mismatch_warnings"]

log = logging.getLogger("trainer.mismatch")

#: What to suspect when the sampler and the trainer disagree.
SUSPECTS = (
    "a stale or partly applied weight sync (sync.verify=true checks each one), a LoRA adapter "
    "load the engine skipped, logprobs taken after temperature or another sampling transform "
    "(generator.sampling), or another precision or kernel on one side; under "
    "trainer.strategy=fully_async, weights up to max_staleness_steps old are expected"
)

#: Each thresholded diagnostic: its ``algorithm.mismatch`` key, the metric, and the comparison
#: that crosses it (with its word in the warning).
_CHECKS: tuple[tuple[str, str, Callable[[float, float], bool], str], ...] = (
    ("max_logprob_abs_diff_mean", "mismatch/logprob_abs_diff_mean", operator.gt, "above"),
    ("min_prob_pearson", "mismatch/prob_pearson", operator.lt, "below"),
    ("min_is_ess", "mismatch/is_ess", operator.lt, "below"),
)


def batch_mismatch_sums(ctx: RunContext, batch: TrainBatch) -> dict[str, float]:
    """The batch's :data:`~trainer.algorithms.MISMATCH_SUMS` where the loop has recomputed its
    old logprobs (call it before a rejection mask changes ``loss_mask``); else ``{}``."""
    if (
        batch.old_logprobs is None
        or batch.rollout_logprobs is None
        or ctx.cfg.plan.correction.bypass_mode
    ):
        return {}
    return mismatch_sums(batch.old_logprobs, batch.rollout_logprobs, batch.loss_mask)


def finish_mismatch(ctx: RunContext, step: int, metrics: dict[str, object]) -> dict[str, float]:
    """Take the summed :data:`~trainer.algorithms.MISMATCH_SUMS` out of the step's ``metrics``
    and return the ``mismatch/*`` metrics with ``mismatch/crossed``, warning for each crossing
    (:func:`mismatch_warnings`). ``{}`` where the step has no sums (``bypass_mode``)."""
    sums = {k: float(metrics.pop(k)) for k in MISMATCH_SUMS if k in metrics}  # type: ignore[arg-type]
    out = mismatch_metrics(sums)
    if not out:
        return {}
    crossed = mismatch_warnings(out, attrs.asdict(ctx.cfg.algorithm.mismatch), step)
    return out | {"mismatch/crossed": float(crossed)}


def mismatch_warnings(
    metrics: Mapping[str, float], thresholds: Mapping[str, float | None], step: int
) -> int:
    """Warn (logger ``trainer.mismatch``) for each diagnostic in ``metrics`` past its threshold
    in ``thresholds`` (``algorithm.mismatch``'s keys and values; a None threshold never warns):
    the step, the metric, its value, the threshold's key and value, and :data:`SUSPECTS`; one
    message template per diagnostic, so each is its own kind of repeated warning. Returns how
    many crossed."""
    crossed = 0
    for key, metric, past, word in _CHECKS:
        bound = thresholds.get(key)
        value = metrics.get(metric)
        if bound is None or value is None or not past(value, bound):
            continue
        crossed += 1
        log.warning(
            f"step %d: {metric}=%.4g is {word} algorithm.mismatch.{key}=%g: the engine and the "
            "trainer disagree on the sampled tokens; suspect %s",
            step,
            value,
            bound,
            SUSPECTS,
        )
    return crossed
