"""``algorithm.rollout_correction``: what the run does about the sampler's and the trainer's
disagreement on the sampled tokens (verl's ``algorithm.rollout_correction.*``, same key names),
and :func:`plan_correction`, which turns it (with the older ``algorithm.off_policy_correction``
and ``tis_cap``) into the one :class:`~trainer.algorithms.RolloutCorrection` the run acts on.
docs/algorithms.md#rollout-corrections.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from trainer.algorithms import (
    DEFAULT_RS_BOUNDS,
    ROLLOUT_IS,
    ROLLOUT_RS,
    RolloutCorrection,
    RolloutIsName,
    RolloutRsName,
)
from trainer.config._fields import config_field as _field
from trainer.config._fields import positive
from trainer.errors import ConfigError

__all__ = [
    "ASYNC_CORRECTION_CHOICES",
    "RolloutCorrectionConfig",
    "correction_note",
    "plan_correction",
]


@attrs.define
class RolloutCorrectionConfig:
    rollout_is: RolloutIsName | None = _field(
        None,
        "Importance weights on each token's policy loss (truncated importance sampling): "
        + ", ".join(ROLLOUT_IS.names)
        + " (token: min(exp(old - rollout), rollout_is_threshold) per token; sequence: the "
        "product over the sequence, truncated, on each of its tokens); None: no weights "
        "(algorithm.off_policy_correction decides). docs/algorithms.md#rollout-corrections.",
    )
    rollout_is_threshold: float | None = _field(
        2.0,
        "rollout_is: the largest weight (policy/is_truncated_frac is the share it caps); "
        "None: untruncated.",
        check=positive,
    )
    rollout_rs: RolloutRsName | None = _field(
        None,
        "Rejection mask: tokens or sequences whose old-over-rollout ratio falls outside "
        "[rollout_rs_threshold_lower, rollout_rs_threshold] leave the loss, its counts and the "
        "advantages: "
        + ", ".join(ROLLOUT_RS.names)
        + " (token, sequence: masked importance sampling on the token's ratio or the "
        "sequence's product; geometric: exp(mean log-ratio) of the sequence; icepop: tokens "
        "outside [1/b, b], b = rollout_rs_threshold). None: no mask.",
    )
    rollout_rs_threshold: float | None = _field(
        None,
        "rollout_rs: the upper bound on the ratio (icepop: b); None: the mask's default "
        "(token, sequence, icepop: 2; geometric: 1.01).",
        check=positive,
    )
    rollout_rs_threshold_lower: float | None = _field(
        None,
        "rollout_rs: the lower bound on the ratio; None: 1 / rollout_rs_threshold (geometric "
        "unset: 0.99). Not read by icepop (its band is [1/b, b]).",
        check=positive,
    )
    bypass_mode: bool = _field(
        False,
        "Take the rollout's logprobs as the old policy's and skip their recompute: the PPO "
        "ratio is then against the sampler itself, which corrects the gap (verl's bypass "
        "mode). Needs rollout logprobs; rollout_is and rollout_rs would see a ratio of 1 "
        "and are refused with it.",
    )
    allow_uncorrected: bool = _field(
        False,
        "A trainer.strategy=fully_async run with max_staleness_steps > 0 and "
        "algorithm.off_policy_correction=none and no rollout_correction is refused at load; "
        "true runs it uncorrected anyway, saying so at the start (for comparisons: "
        "benchmarks/mismatch.py). Nothing else reads it.",
    )


class _Algorithm(Protocol):
    """The keys of ``algorithm`` the correction is made of."""

    @property
    def off_policy_correction(self) -> str: ...
    @property
    def tis_cap(self) -> float | None: ...
    @property
    def rollout_correction(self) -> RolloutCorrectionConfig: ...


#: What a fully-async run with staleness can correct with: the keys that choose one.
ASYNC_CORRECTION_CHOICES = (
    "algorithm.off_policy_correction=tis (or auto, the default: token TIS capped at tis_cap), "
    "algorithm.rollout_correction.rollout_is=token|sequence, "
    "algorithm.rollout_correction.rollout_rs=token|sequence|geometric|icepop, "
    "algorithm.rollout_correction.bypass_mode=true"
)


def _chooses_nothing(a: _Algorithm) -> bool:
    rc = a.rollout_correction
    return rc.rollout_is is None and rc.rollout_rs is None and not rc.bypass_mode


def plan_correction(a: _Algorithm, fully_async: bool, *, staleness: int = 0) -> RolloutCorrection:
    """The run's correction. ``algorithm.rollout_correction.*`` where set; else
    ``algorithm.off_policy_correction`` (``tis``: token weights capped at ``tis_cap``; ``auto``:
    that under ``fully_async``, none under ``sync``). ``ConfigError`` (one line, naming the
    keys) for settings that contradict each other, and for a fully-async run that may train on
    samples ``staleness > 0`` steps old with every correction turned off
    (``off_policy_correction=none`` and no ``rollout_correction``): the line names the
    choices (miles refuses the same since its PR #1829)."""
    rc = a.rollout_correction
    uncorrected = fully_async and staleness > 0 and a.off_policy_correction == "none"
    if uncorrected and _chooses_nothing(a) and not rc.allow_uncorrected:
        raise ConfigError(
            f"config: trainer.strategy=fully_async with max_staleness_steps={staleness} trains "
            "on samples of older weights, and algorithm.off_policy_correction=none with no "
            f"algorithm.rollout_correction corrects nothing: choose one of {ASYNC_CORRECTION_CHOICES}"
            " (or max_staleness_steps=0; algorithm.rollout_correction.allow_uncorrected=true "
            "runs it uncorrected on purpose)"
        )
    rollout_is, threshold = rc.rollout_is, rc.rollout_is_threshold
    if rollout_is is not None and a.off_policy_correction == "tis":
        raise ConfigError(
            "config: algorithm.off_policy_correction='tis' and "
            f"algorithm.rollout_correction.rollout_is={rollout_is!r} both choose importance "
            "weights: set one (off_policy_correction=tis is rollout_is=token with "
            "rollout_is_threshold=tis_cap)"
        )
    legacy = a.off_policy_correction == "tis" or (a.off_policy_correction == "auto" and fully_async)
    if rollout_is is None and legacy and not rc.bypass_mode:
        rollout_is, threshold = "token", a.tis_cap
    if rc.bypass_mode and (rc.rollout_is is not None or rc.rollout_rs is not None):
        raise ConfigError(
            "config: algorithm.rollout_correction.bypass_mode=true takes the rollout's logprobs "
            "as the old policy's, so rollout_is and rollout_rs would see a ratio of exactly 1: "
            "unset them, or bypass_mode"
        )
    if rc.bypass_mode and a.off_policy_correction == "tis":
        raise ConfigError(
            "config: algorithm.rollout_correction.bypass_mode=true leaves "
            "algorithm.off_policy_correction='tis' a ratio of exactly 1: set it to none or auto"
        )
    lower, upper = _rs_bounds(rc)
    return RolloutCorrection(
        rollout_is=rollout_is,
        rollout_is_threshold=threshold,
        rollout_rs=rc.rollout_rs,
        rs_lower=lower,
        rs_upper=upper,
        bypass_mode=rc.bypass_mode,
    )


def correction_note(a: _Algorithm, fully_async: bool, *, staleness: int = 0) -> str | None:
    """The line a run logs at its start when the correction was chosen for it: a fully-async
    run that may train on samples ``staleness > 0`` steps old, with ``off_policy_correction=auto``
    and no ``rollout_correction``, corrects with token TIS by default; with
    ``off_policy_correction=none`` and ``rollout_correction.allow_uncorrected``, it corrects
    nothing; None otherwise."""
    if not (fully_async and staleness > 0 and _chooses_nothing(a)):
        return None
    if a.off_policy_correction == "none" and a.rollout_correction.allow_uncorrected:
        return (
            f"trainer.strategy=fully_async with max_staleness_steps={staleness}: training on "
            "stale samples UNCORRECTED (algorithm.off_policy_correction=none, "
            "algorithm.rollout_correction.allow_uncorrected=true)"
        )
    if a.off_policy_correction != "auto":
        return None
    cap = "untruncated" if a.tis_cap is None else f"capped at tis_cap={a.tis_cap:g}"
    return (
        f"trainer.strategy=fully_async with max_staleness_steps={staleness}: correcting the "
        f"stale samples with token TIS {cap} (algorithm.off_policy_correction="
        f"auto, the default; docs/async.md#off-policy-correction); choose another with "
        f"{ASYNC_CORRECTION_CHOICES}"
    )


def _rs_bounds(rc: RolloutCorrectionConfig) -> tuple[float, float]:
    """The mask's ``(lower, upper)``, defaults applied; ``ConfigError`` for an empty band."""
    key = "algorithm.rollout_correction"
    default_lower, default_upper = DEFAULT_RS_BOUNDS.get(rc.rollout_rs or "token", (0.5, 2.0))
    upper = rc.rollout_rs_threshold or default_upper
    if rc.rollout_rs == "icepop":
        if rc.rollout_rs_threshold_lower is not None:
            raise ConfigError(
                f"config: {key}.rollout_rs='icepop' keeps tokens in [1/b, b] with b = "
                "rollout_rs_threshold: unset rollout_rs_threshold_lower (or use rollout_rs=token)"
            )
        if upper <= 1:
            raise ConfigError(
                f"config: {key}.rollout_rs_threshold={upper} must be > 1 for icepop's [1/b, b]"
            )
        return 1.0 / upper, upper
    if rc.rollout_rs_threshold_lower is not None:
        lower = rc.rollout_rs_threshold_lower
    elif rc.rollout_rs_threshold is None:
        lower = default_lower
    else:
        lower = 1.0 / upper
    if rc.rollout_rs is not None and not lower < upper:
        raise ConfigError(
            f"config: {key}.rollout_rs_threshold_lower={lower:g} must be below "
            f"rollout_rs_threshold={upper:g} (tokens are kept where lower <= ratio <= upper)"
        )
    return lower, upper
