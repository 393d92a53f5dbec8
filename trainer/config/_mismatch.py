"""``algorithm.mismatch``: the thresholds past which a step's mismatch diagnostics
(``mismatch/*``, :mod:`trainer.algorithms._mismatch`) warn on the console.
docs/algorithms.md#mismatch-diagnostics.
"""

from __future__ import annotations

import attrs

from trainer.config._fields import config_field as _field
from trainer.config._fields import in_range, positive

__all__ = ["DEFAULT_MISMATCH_THRESHOLDS", "MismatchConfig"]

#: The defaults: far outside what a healthy run shows (the same weights in another kernel or
#: precision give a mean |diff| near 0.01, a correlation above 0.99 and an ESS above 0.95), well
#: inside what a stale or half-applied sync shows.
DEFAULT_MISMATCH_THRESHOLDS = {
    "max_logprob_abs_diff_mean": 0.1,
    "min_prob_pearson": 0.9,
    "min_is_ess": 0.5,
}


@attrs.define
class MismatchConfig:
    max_logprob_abs_diff_mean: float | None = _field(
        DEFAULT_MISMATCH_THRESHOLDS["max_logprob_abs_diff_mean"],
        "Warn where a step's mismatch/logprob_abs_diff_mean (the mean |trainer - engine| "
        "logprob of the sampled tokens) is above this; None: never.",
        check=positive,
    )
    min_prob_pearson: float | None = _field(
        DEFAULT_MISMATCH_THRESHOLDS["min_prob_pearson"],
        "Warn where a step's mismatch/prob_pearson (the correlation of the trainer's and the "
        "engine's probabilities of the sampled tokens) is below this; None: never.",
        check=in_range(-1, 1),
    )
    min_is_ess: float | None = _field(
        DEFAULT_MISMATCH_THRESHOLDS["min_is_ess"],
        "Warn where a step's mismatch/is_ess (the normalized effective sample size of the "
        "untruncated importance weights, in (0, 1]) is below this; None: never.",
        check=in_range(0, 1),
    )
