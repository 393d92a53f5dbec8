"""Policy losses: ``algorithm.policy_loss`` (the registry :data:`~trainer.algorithms.POLICY_LOSSES`).
Pure torch, no trio, no I/O.

Each loss reads a :class:`LossInputs` (the policy's log-probs with their gradient, the old
policy's, the advantages, the clip ranges) and returns the per-token loss ``[B, T]`` and its
own metrics; :func:`policy_loss` checks the inputs, weighs each token by the off-policy
correction's weight (truncated importance sampling, :mod:`trainer.off_policy`: it composes with
every loss, multiplying each token's term as verl does), aggregates
(:mod:`trainer.algorithms._aggregation`) and adds the metrics every loss shares.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from trainer.algorithms._aggregation import BatchCounts, aggregate
from trainer.algorithms._cov_losses import CLIP_COV_DEFAULTS, KL_COV_DEFAULTS, clip_cov, kl_cov
from trainer.algorithms._dro import DRO_DEFAULTS, dro
from trainer.algorithms._ops import LOG_RATIO_CLAMP, masked_mean, valid_mask
from trainer.algorithms._registry import POLICY_LOSSES

__all__ = [
    "COMMON_METRICS",
    "DEFAULT_CLIP_HIGH",
    "DEFAULT_CLIP_LOW",
    "POLICY_LOSS_METRICS",
    "LossInputs",
    "cispo",
    "clip_cov",
    "dro",
    "gspo",
    "kl_cov",
    "policy_loss",
    "ppo",
]

#: PPO clip range below 1 (ratio floor ``1 - clip_low``).
DEFAULT_CLIP_LOW = 0.2
#: PPO clip range above 1 (ratio ceiling ``1 + clip_high``); raise it for "clip-higher" (DAPO).
DEFAULT_CLIP_HIGH = 0.2
#: The metrics of every loss (over this call's trained tokens): ``pg_loss`` (the loss value),
#: ``approx_kl`` (mean of ``old - new`` log-probs), the token ratio ``exp(new - old)``'s mean,
#: max and min, and ``num_tokens``.
COMMON_METRICS: tuple[str, ...] = (
    "pg_loss",
    "approx_kl",
    "ratio_mean",
    "ratio_max",
    "ratio_min",
    "num_tokens",
)
#: The metrics ``policy_loss`` returns for each loss: the common ones and the loss's own.
POLICY_LOSS_METRICS: dict[str, tuple[str, ...]] = {
    "ppo": (*COMMON_METRICS, "clip_frac", "clip_frac_high", "clip_frac_low", "dual_clip_frac"),
    "gspo": (*COMMON_METRICS, "clip_frac", "seq_ratio_mean", "seq_ratio_max", "seq_ratio_min"),
    "cispo": (*COMMON_METRICS, "clip_frac", "clip_frac_high", "clip_frac_low"),
    "clip_cov": (*COMMON_METRICS, "clip_frac", "cov_clip_frac", "cov_candidates_frac"),
    "kl_cov": (*COMMON_METRICS, "kl_cov_frac", "abs_kl"),
    "dro": (*COMMON_METRICS, "dro_penalty"),
}
#: Each loss's own parameters and their defaults (``loss_options`` overrides them).
LOSS_OPTIONS: dict[str, dict[str, float]] = {
    "clip_cov": CLIP_COV_DEFAULTS,
    "kl_cov": KL_COV_DEFAULTS,
    "dro": DRO_DEFAULTS,
}


@attrs.frozen
class LossInputs:
    """What a loss reads. Every tensor is ``[B, T]`` and zero at masked positions except
    ``logprobs`` (which carries the gradient; use it through ``valid``)."""

    logprobs: torch.Tensor
    #: ``logprobs - old_logprobs``, detached from ``old``, clamped to ``±LOG_RATIO_CLAMP``.
    log_ratio: torch.Tensor
    #: The same before the clamp (zero at masked positions): what a sequence-level ratio
    #: averages, so one wild token moves its sequence's mean by its whole log-ratio.
    raw_log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    clip_low: float
    clip_high: float
    #: Dual-clip's bound on the ratio for negative advantages (``ppo``); None: off.
    clip_ratio_c: float | None
    #: The loss's own parameters (:data:`LOSS_OPTIONS`: ``clip_cov``'s, ``kl_cov``'s, ``dro``'s).
    options: Mapping[str, float] = attrs.field(factory=dict)

    @property
    def ratio(self) -> torch.Tensor:
        return torch.exp(self.log_ratio)

    def frac(self, flags: torch.Tensor) -> float:
        """The share of trained tokens where ``flags`` holds."""
        return float((flags & self.valid).sum()) / max(int(self.valid.sum()), 1)


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss: str = "ppo",
    clip_low: float = DEFAULT_CLIP_LOW,
    clip_high: float = DEFAULT_CLIP_HIGH,
    clip_ratio_c: float | None = None,
    loss_agg_mode: str = "token-mean",
    counts: BatchCounts | None = None,
    scale_factor: float | None = None,
    token_weights: torch.Tensor | None = None,
    loss_options: Mapping[str, float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss named ``loss`` (``ppo``, ``gspo``, ``cispo``, ``clip_cov``, ``kl_cov``,
    ``dro``),
    aggregated by ``loss_agg_mode``, and its metrics. ``loss_options``: the loss's own
    parameters (:data:`LOSS_OPTIONS`; unset ones take their defaults, others are refused).

    ``logprobs``, ``old_logprobs`` and ``mask`` are ``[B, T]``; ``advantages`` ``[B]`` (one per
    trajectory, broadcast over its tokens) or ``[B, T]``. ``counts``: the whole mini-batch's
    (:class:`BatchCounts`; default this call's own): pass the same to every micro-batch and
    rank and the accumulated gradients equal one full-batch call's exactly.
    ``token_weights`` (``[B, T]``, never differentiated) multiplies each token's loss: the
    off-policy correction's importance weights.

    Metrics (plain floats, over this call's trained tokens whatever ``counts`` is):
    :data:`POLICY_LOSS_METRICS` of the loss. With no trained token the loss is ``0.0`` (still
    part of the graph) and every metric ``0.0``. Masked positions of log-probs, advantages and
    weights are zeroed first and log-ratios clamped, so garbage there cannot produce
    ``inf``/``nan`` values or gradients.

    Raises ``ValueError`` for an unknown loss or mode (naming the allowed ones), mismatched
    shapes, ``clip_low`` outside ``[0, 1]`` (1: no floor, as CISPO's recipes use), a negative ``clip_high``, a ``clip_ratio_c`` not
    above 1, or ``gspo`` with a mode other than ``seq-mean-token-mean`` (its objective is one
    term per sequence).
    """
    fn = POLICY_LOSSES.get(loss)
    _check_shapes(logprobs, old_logprobs, mask, token_weights)
    _check_clip_ranges(clip_low, clip_high, clip_ratio_c)
    _check_agg_mode(loss, loss_agg_mode)
    options = _options(loss, loss_options or {})
    inputs = _loss_inputs(
        logprobs,
        old_logprobs,
        _per_token_advantages(advantages, logprobs),
        valid_mask(logprobs, mask),
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
    )
    per_token, own = fn(attrs.evolve(inputs, options=options))
    if token_weights is not None:
        weights = token_weights.detach().to(per_token)
        per_token = per_token * _zero_where_masked(weights, inputs.valid, logprobs)
    value = aggregate(per_token, inputs.valid, loss_agg_mode, counts, scale_factor=scale_factor)
    return value, _metrics(loss, value, inputs, own)


def _check_shapes(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    mask: torch.Tensor,
    token_weights: torch.Tensor | None,
) -> None:
    if logprobs.shape != old_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(
            "logprobs, old_logprobs and mask must have one shape [B, T]; got "
            f"{tuple(logprobs.shape)}, {tuple(old_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if token_weights is not None and token_weights.shape != logprobs.shape:
        raise ValueError(
            f"token_weights must have logprobs' shape {tuple(logprobs.shape)}, "
            f"got {tuple(token_weights.shape)}"
        )


def _check_clip_ranges(clip_low: float, clip_high: float, clip_ratio_c: float | None) -> None:
    if not 0 <= clip_low <= 1:
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
    if clip_high < 0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if clip_ratio_c is not None and clip_ratio_c <= 1:
        raise ValueError(f"clip_ratio_c (dual-clip) must be > 1, got {clip_ratio_c}")


def _check_agg_mode(loss: str, loss_agg_mode: str) -> None:
    if loss == "gspo" and loss_agg_mode != "seq-mean-token-mean":
        raise ValueError(
            "policy loss 'gspo' is one term per sequence (GSPO, eq. 5): its loss_agg_mode is "
            f"'seq-mean-token-mean', got {loss_agg_mode!r}"
        )


def _options(loss: str, given: Mapping[str, float]) -> dict[str, float]:
    """``loss``'s parameters: its defaults, overridden by ``given``; ``ValueError`` for a
    parameter the loss does not have."""
    defaults = LOSS_OPTIONS.get(loss, {})
    if unknown := set(given) - set(defaults):
        raise ValueError(
            f"policy loss {loss!r} has no option {', '.join(sorted(unknown))}; "
            f"its options: {', '.join(defaults) or 'none'}"
        )
    return {**defaults, **given}


def _per_token_advantages(advantages: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """``advantages`` ``[B]`` as ``[B, 1]`` (broadcast over each trajectory's tokens), or
    ``[B, T]`` as it is; ``ValueError`` for any other shape."""
    if advantages.shape == logprobs.shape[:1] and logprobs.dim() == 2:
        return advantages.unsqueeze(-1)
    if advantages.shape == logprobs.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] for logprobs of shape {tuple(logprobs.shape)}, "
        f"got {tuple(advantages.shape)}"
    )


def _zero_where_masked(x: torch.Tensor, valid: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` on trained tokens, else zero (``like``'s dtype and device)."""
    return torch.where(valid, x, torch.zeros((), dtype=like.dtype, device=like.device))


def _loss_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    valid: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_ratio_c: float | None,
) -> LossInputs:
    """What a loss reads: masked positions zeroed (an inf advantage there would make
    ``0 * inf = nan`` gradients), the log-ratio detached from ``old`` and clamped."""
    adv = advantages.detach().to(logprobs.dtype).expand_as(logprobs)
    log_ratio = _zero_where_masked(logprobs - old_logprobs.detach(), valid, logprobs)
    return LossInputs(
        logprobs=_zero_where_masked(logprobs, valid, logprobs),
        log_ratio=log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP),
        raw_log_ratio=log_ratio,
        advantages=_zero_where_masked(adv, valid, logprobs),
        valid=valid,
        clip_low=clip_low,
        clip_high=clip_high,
        clip_ratio_c=clip_ratio_c,
    )


@torch.no_grad()
def _metrics(
    loss: str, value: torch.Tensor, x: LossInputs, own: dict[str, float]
) -> dict[str, float]:
    """:data:`COMMON_METRICS` over the trained tokens, then the loss's ``own`` (every one
    ``0.0`` but ``pg_loss`` when no token is trained)."""
    n_valid = int(x.valid.sum())
    if n_valid == 0:
        metrics = dict.fromkeys(POLICY_LOSS_METRICS[loss], 0.0)
        metrics["pg_loss"] = float(value.detach())
        return metrics
    ratio = x.ratio[x.valid]
    return {
        "pg_loss": float(value.detach()),
        "approx_kl": float(masked_mean(-x.log_ratio, x.valid)),
        "ratio_mean": float(ratio.mean()),
        "ratio_max": float(ratio.max()),
        "ratio_min": float(ratio.min()),
        "num_tokens": float(n_valid),
    } | own


def ppo(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (Schulman et al. 2017) with clip-higher (DAPO, Yu et al. 2025: separate
    ``clip_low``/``clip_high``) and dual-clip (Ye et al. 2020, arXiv:1912.09729): verl's
    ``vanilla``, SkyRL's ``regular``/``dual_clip``. Per trained token, ``r = exp(logp - old)``::

        l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        l_t = min(l_t, -A c)      where A < 0, with c = clip_ratio_c (if set)

    Dual-clip bounds what a negative-advantage token with a huge ratio can contribute.
    Metrics: ``clip_frac`` (tokens where the clipped term is active, so the gradient is zero),
    split into ``clip_frac_high``/``clip_frac_low`` by ``A > 0``/``A < 0``, and
    ``dual_clip_frac`` (tokens where the dual clip is active).
    """
    ratio, adv = x.ratio, x.advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - x.clip_low, 1.0 + x.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(x.valid)
    if x.clip_ratio_c is not None:
        bound = -adv * x.clip_ratio_c
        dual = (adv < 0) & (per_token > bound)
        per_token = torch.where(dual, bound, per_token)
    is_clipped = clipped > unclipped
    return per_token, {
        "clip_frac": x.frac(is_clipped),
        "clip_frac_high": x.frac(is_clipped & (adv > 0)),
        "clip_frac_low": x.frac(is_clipped & (adv < 0)),
        "dual_clip_frac": x.frac(dual),
    }


def gspo(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, arXiv:2507.18071; verl ``gspo``, SkyRL ``gspo``): the importance
    ratio of a whole sequence, ``s_i = exp(mean_t (logp_it - old_it))`` (length-normalized),
    clipped per sequence, one term per sequence (aggregated ``seq-mean-token-mean``)::

        l_it = max(-A s_it, -A clip(s_it, 1 - clip_low, 1 + clip_high))
        s_it = sg[s_i] * exp(logp_it - sg[logp_it])     (GSPO-token: value s_i)

    so the gradient of sequence ``i`` is ``s_i A_i mean_t grad logp_it`` where unclipped. The
    paper's clip ranges are far narrower than PPO's (3e-4 and 4e-4). Metrics: ``clip_frac``
    (tokens of clipped sequences), ``seq_ratio_mean``/``_max``/``_min`` over the sequences.

    The mean is of the raw token log-ratios, as the paper and verl take it; only the sequence's
    log-ratio is clamped, to ``±LOG_RATIO_CLAMP`` (20) against overflow. verl clamps it at 10,
    and at the maximum only: a sequence whose mean log-ratio lies in (10, 20] or below -20 has
    another loss there (no clip range comes near either bound).
    """
    n = x.valid.sum(dim=-1).clamp(min=1).to(x.raw_log_ratio.dtype)
    seq_log_ratio = x.raw_log_ratio.sum(dim=-1) / n
    log_s = x.logprobs - x.logprobs.detach() + seq_log_ratio.detach()[:, None]
    s = torch.exp(log_s.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -x.advantages * s
    clipped = -x.advantages * s.clamp(1.0 - x.clip_low, 1.0 + x.clip_high)
    per_token = torch.maximum(unclipped, clipped)
    has_tokens = x.valid.any(dim=-1)
    seq_ratio = torch.exp(seq_log_ratio.detach().clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    seq_ratio = seq_ratio[has_tokens]
    if seq_ratio.numel() == 0:
        seq_ratio = torch.zeros(1, dtype=s.dtype)
    return per_token, {
        "clip_frac": x.frac(clipped > unclipped),
        "seq_ratio_mean": float(seq_ratio.mean()),
        "seq_ratio_max": float(seq_ratio.max()),
        "seq_ratio_min": float(seq_ratio.min()),
    }


def cispo(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """CISPO (MiniMax-M1, arXiv:2506.13585; verl ``cispo``, SkyRL ``cispo``): REINFORCE with
    the importance weight clipped and its gradient stopped, so no token's gradient is dropped
    (PPO's clip zeroes the gradient of clipped tokens; CISPO only bounds their weight)::

        l_t = -sg[clip(r_t, 1 - clip_low, 1 + clip_high)] A logp_t

    The loss *value* includes ``logp`` and is not comparable with PPO's; its gradient is.
    MiniMax leave the lower bound off (a large ``clip_low``) and tune the upper. Metrics:
    ``clip_frac`` (tokens whose weight the clip changed), ``clip_frac_high``/``_low`` (ratio
    above/below the range).
    """
    ratio = x.ratio
    weight = ratio.clamp(1.0 - x.clip_low, 1.0 + x.clip_high).detach()
    per_token = -weight * x.advantages * x.logprobs
    high = ratio > 1.0 + x.clip_high
    low = ratio < 1.0 - x.clip_low
    return per_token, {
        "clip_frac": x.frac(high | low),
        "clip_frac_high": x.frac(high),
        "clip_frac_low": x.frac(low),
    }
