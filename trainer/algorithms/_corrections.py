"""Rollout corrections: what a step does about the gap between the sampler's and the trainer's
probabilities of the sampled tokens (``algorithm.rollout_correction.*``, the registries
:data:`~trainer.algorithms.ROLLOUT_IS` and :data:`~trainer.algorithms.ROLLOUT_RS`). Pure torch.

Each correction is a function of ``log_ratio = old_logprobs - rollout_logprobs`` (``[B, T]``,
zero at masked tokens: the log of the importance ratio ``rho_t = pi_old(y_t) / pi_rollout(y_t)``)
and the trained tokens ``valid``. Two kinds, composable (verl's ``rollout_is`` and
``rollout_rs``):

- **importance sampling** (``rollout_is``) returns detached per-token *weights* that multiply
  each token's policy loss (truncated importance sampling, TIS; Yao et al. 2025, "Your efficient
  RL framework secretly brings you off-policy RL training");
- **rejection sampling** (``rollout_rs``) returns a *keep* mask: rejected tokens (or whole
  sequences) leave the loss, its counts and the advantages, as masked importance sampling
  (MIS) and IcePop do.

Every function returns its tensor and plain-float metrics (names as in
:data:`CORRECTION_METRICS`; the worker and the loop prefix them with ``policy/``). Log-ratios
are clamped to ``±LOG_RATIO_CLAMP`` before ``exp`` (the same bound as verl's ``SAFETY_BOUND``).
"""

from __future__ import annotations

import torch

from trainer.algorithms._ops import LOG_RATIO_CLAMP
from trainer.algorithms._registry import ROLLOUT_IS, ROLLOUT_RS, RolloutCorrection

__all__ = [
    "CORRECTION_METRICS",
    "geometric_rs",
    "icepop_rs",
    "importance_weights_of",
    "rejection_mask_of",
    "sequence_is",
    "sequence_rs",
    "token_is",
    "token_rs",
]

#: The metrics of each kind: ``is_truncated_frac`` (the share of weights the cap lowered: of
#: tokens for ``token``, of sequences for ``sequence``), the untruncated weights' tails
#: ``is_weight_p99`` and ``is_weight_max``; ``rs_rejected_frac`` (the share of trained tokens a
#: mask drops) and ``rs_rejected_seq_frac`` (the share of sequences it drops whole).
CORRECTION_METRICS: dict[str, tuple[str, ...]] = {
    "rollout_is": ("is_truncated_frac", "is_weight_p99", "is_weight_max"),
    "rollout_rs": ("rs_rejected_frac", "rs_rejected_seq_frac"),
}


def _seq_log_ratio(log_ratio: torch.Tensor, valid: torch.Tensor, *, mean: bool) -> torch.Tensor:
    """``[B]``: the sum (or mean) over each sequence's trained tokens of the log-ratio, clamped."""
    total = torch.where(valid, log_ratio, torch.zeros_like(log_ratio)).sum(dim=-1)
    if mean:
        total = total / valid.sum(dim=-1).clamp(min=1).to(total.dtype)
    return total.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _tails(values: torch.Tensor) -> dict[str, float]:
    if values.numel() == 0:
        return {"is_weight_p99": 0.0, "is_weight_max": 0.0}
    v = values.double()
    return {"is_weight_p99": float(torch.quantile(v, 0.99)), "is_weight_max": float(v.max())}


def token_is(
    log_ratio: torch.Tensor, valid: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level TIS (verl ``rollout_is=token``, SkyRL ``tis_ratio_type=token``)::

        w_t = min(rho_t, cap)        rho_t = exp(old_t - rollout_t)

    ``cap=None``: untruncated (the decoupled PPO objective's behaviour weight)."""
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    weights = rho if cap is None else rho.clamp(max=cap)
    n = max(int(valid.sum()), 1)
    truncated = (valid & (rho > cap)).sum() if cap is not None else 0
    metrics = {"is_truncated_frac": float(truncated) / n} | _tails(rho[valid])
    return torch.where(valid, weights, torch.zeros_like(weights)), metrics


def sequence_is(
    log_ratio: torch.Tensor, valid: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level TIS (verl ``rollout_is=sequence``, SkyRL ``tis_ratio_type=sequence``): the
    product of the sequence's token ratios, truncated, on each of its tokens::

        w_i = min(prod_t rho_it, cap) = min(exp(sum_t (old_it - rollout_it)), cap)

    Unbiased for the sequence's likelihood ratio (before the cap) where the token form is not,
    at a variance that grows with the length."""
    rho = torch.exp(_seq_log_ratio(log_ratio, valid, mean=False))
    weights = rho if cap is None else rho.clamp(max=cap)
    has = valid.any(dim=-1)
    n = max(int(has.sum()), 1)
    truncated = (has & (rho > cap)).sum() if cap is not None else 0
    metrics = {"is_truncated_frac": float(truncated) / n} | _tails(rho[has])
    per_token = weights[:, None].expand_as(log_ratio)
    return torch.where(valid, per_token, torch.zeros_like(per_token)), metrics


def _kept_sequences(valid: torch.Tensor, keep_seq: torch.Tensor) -> torch.Tensor:
    return valid & keep_seq[:, None]


def token_rs(
    log_ratio: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """Token rejection (MIS, masked importance sampling; verl ``rollout_rs=token_k1``): a token
    leaves the loss where ``rho_t`` is outside ``[lower, upper]``."""
    rho = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return valid & (rho >= lower) & (rho <= upper)


def sequence_rs(
    log_ratio: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """Sequence rejection (MIS at the sequence level; verl ``rollout_rs=seq_sum_k1``): a
    sequence leaves the loss where ``prod_t rho_it = exp(sum_t log rho_it)`` is outside
    ``[lower, upper]``."""
    rho = torch.exp(_seq_log_ratio(log_ratio, valid, mean=False))
    return _kept_sequences(valid, (rho >= lower) & (rho <= upper))


def geometric_rs(
    log_ratio: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """The geometric-mean sequence mask (verl ``rollout_rs=seq_mean_k1``, SkyRL
    ``sequence_mask_metric=geometric``): a sequence leaves the loss where
    ``exp(mean_t log rho_it)`` is outside ``[lower, upper]`` (SkyRL's default ``[0.99, 1.01]``):
    length-independent, where the product drifts with the length."""
    rho = torch.exp(_seq_log_ratio(log_ratio, valid, mean=True))
    return _kept_sequences(valid, (rho >= lower) & (rho <= upper))


def icepop_rs(
    log_ratio: torch.Tensor, valid: torch.Tensor, lower: float, upper: float
) -> torch.Tensor:
    """IcePop's two-sided token mask (the Ring team's IcePop, Ring-1T; SkyRL ``icepop``): a
    token leaves the loss where ``rho_t`` is outside ``[1 / b, b]``, ``b = upper`` (``lower`` is
    not read: the band is symmetric in log space by definition)."""
    return token_rs(log_ratio, valid, 1.0 / upper, upper)


def importance_weights_of(
    spec: RolloutCorrection, log_ratio: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """``spec``'s importance weights (None when ``rollout_is`` is None) and their metrics."""
    if spec.rollout_is is None:
        return None, {}
    weights, metrics = ROLLOUT_IS.get(spec.rollout_is)(log_ratio, valid, spec.rollout_is_threshold)
    return weights.detach(), metrics


def rejection_mask_of(
    spec: RolloutCorrection, log_ratio: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, dict[str, float]]:
    """``valid`` less the tokens ``spec``'s mask rejects (``valid`` itself when ``rollout_rs`` is
    None), and the metrics ``rs_rejected_frac`` and ``rs_rejected_seq_frac``."""
    if spec.rollout_rs is None:
        return valid, {}
    keep = ROLLOUT_RS.get(spec.rollout_rs)(log_ratio, valid, spec.rs_lower, spec.rs_upper)
    keep = keep & valid
    n_tokens = max(int(valid.sum()), 1)
    had = valid.any(dim=-1)
    lost = had & ~keep.any(dim=-1)
    return keep, {
        "rs_rejected_frac": float((valid & ~keep).sum()) / n_tokens,
        "rs_rejected_seq_frac": float(lost.sum()) / max(int(had.sum()), 1),
    }
