"""Off-policy correction: weigh each token by how far the sampler's policy lags the trainer's.

A sample is drawn by the *behaviour* policy (the weights the engine served when it sampled;
its logprobs travel as ``Trajectory.rollout_logprobs``). The PPO ratio is taken against the
*old* policy the trainer recomputes before the update (``old_logprobs``). When the sampler
lags the trainer (fully-async training, or any engine that serves older weights) the two
differ, and the plain PPO loss silently ignores the gap. Truncated importance sampling
(TIS) multiplies each token's PPO-clip term by the detached weight::

    w_t = min(exp(old_logp_t - rollout_logp_t), cap)

With ``cap=None`` the weight is not truncated, and the loss is the decoupled PPO objective
(behaviour weight ``pi_old / pi_behav`` times the PPO-clip surrogate around ``pi_old``).

The corrections themselves are a registry (:mod:`trainer.algorithms._corrections`,
``algorithm.rollout_correction.*``): importance weights (token or sequence TIS) the worker
multiplies into each token's loss, and rejection masks (token, sequence, geometric, IcePop)
the loop applies to the batch's loss mask before the advantages. ``"tis"`` is token-level TIS.

Usage in a worker::

    weights, metrics = correction_weights(old_logp, rollout_logp, mask, plan.correction)
    loss, _ = policy_loss(logp, old_logp, adv, mask, token_weights=weights)

and in the loop, once the old logprobs are known::

    batch.loss_mask, metrics = rejection_mask(old_logp, rollout_logp, mask, plan.correction)
"""

from __future__ import annotations

import torch

from trainer.algorithms import (
    LOG_RATIO_CLAMP,
    OFF_POLICY_CORRECTIONS,
    OffPolicyCorrection,
    RolloutCorrection,
    importance_weights_of,
    rejection_mask_of,
)

__all__ = [
    "DEFAULT_TIS_CAP",
    "IS_RATIO_METRICS",
    "OFF_POLICY_CORRECTIONS",
    "OffPolicyCorrection",
    "RolloutCorrection",
    "correction_weights",
    "importance_weights",
    "rejection_mask",
]

#: The default truncation of the importance weight (``algorithm.tis_cap``), as in verl's
#: ``tis_imp_ratio_cap`` examples.
DEFAULT_TIS_CAP = 2.0
#: The metrics ``importance_weights`` returns with correction ``"none"``; ``"tis"`` adds
#: ``is_truncated_frac``, ``is_weight_p99`` and ``is_weight_max``.
IS_RATIO_METRICS: tuple[str, ...] = ("is_ratio_mean", "is_ratio_max", "is_ratio_min")


def importance_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    correction: OffPolicyCorrection,
    *,
    cap: float | None = DEFAULT_TIS_CAP,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The per-token weights for ``policy_loss(token_weights=...)``, and their metrics.

    ``"none"``: no weights (``None``; the loss is exactly the plain PPO-clip loss), but the
    metrics still say how off-policy the batch is. ``"tis"``: ``min(exp(old - rollout), cap)``
    at valid tokens (``cap=None``: untruncated), ``0.0`` at masked ones; no gradient.

    Metrics (plain floats, over valid tokens): ``is_ratio_mean``, ``is_ratio_max`` and
    ``is_ratio_min`` of ``exp(old - rollout)`` before truncation, and with ``"tis"``
    ``is_truncated_frac``, the share of tokens whose weight the cap lowered (``0.0`` without
    a cap), and the untruncated ratio's tails ``is_weight_p99`` and ``is_weight_max``. In a synchronous run the engine samples with the trained weights, so the ratio
    is near 1 (off by the engine's and trainer's numerics only). With no valid token every
    metric is ``0.0``.

    The log-ratio is zeroed at masked positions and clamped to ``±LOG_RATIO_CLAMP`` before
    ``exp``, so garbage there (or one wild token) cannot produce ``inf``/``nan``.

    Raises ``ValueError`` for an unknown correction (naming the allowed ones), mismatched
    shapes or ``cap <= 0``.
    """
    if correction not in OFF_POLICY_CORRECTIONS:
        raise ValueError(
            f"unknown off-policy correction {correction!r}; "
            f"allowed: {', '.join(OFF_POLICY_CORRECTIONS)}"
        )
    if old_logprobs.shape != rollout_logprobs.shape or old_logprobs.shape != mask.shape:
        raise ValueError(
            "old_logprobs, rollout_logprobs and mask must have one shape [B, T]; got "
            f"{tuple(old_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, {tuple(mask.shape)}"
        )
    if cap is not None and cap <= 0:
        raise ValueError(f"cap must be > 0 (or None for no truncation), got {cap}")
    spec = RolloutCorrection(
        rollout_is="token" if correction == "tis" else None, rollout_is_threshold=cap
    )
    return correction_weights(old_logprobs, rollout_logprobs, mask, spec)


def _log_ratio(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(old - rollout`` zeroed at masked positions, the trained tokens as bool)``."""
    valid = mask.to(device=old_logprobs.device) != 0
    zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
    return torch.where(valid, old_logprobs - rollout_logprobs.to(old_logprobs), zero), valid


@torch.no_grad()
def correction_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: RolloutCorrection,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """``spec``'s importance weights for ``policy_loss(token_weights=...)`` (None without
    ``rollout_is``: the loss is then exactly the plain one), and the metrics: always
    ``is_ratio_mean``/``_max``/``_min`` of ``exp(old - rollout)`` over the trained tokens (how
    off-policy the batch is), and with ``rollout_is`` its own (``is_truncated_frac``,
    ``is_weight_p99``, ``is_weight_max``). Every metric ``0.0`` with no trained token; weights
    ``0.0`` at masked positions; no gradient."""
    log_ratio, valid = _log_ratio(old_logprobs, rollout_logprobs, mask)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    if int(valid.sum()) == 0:
        metrics = dict.fromkeys(IS_RATIO_METRICS, 0.0)
    else:
        r_valid = ratio[valid]
        metrics = {
            "is_ratio_mean": float(r_valid.mean()),
            "is_ratio_max": float(r_valid.max()),
            "is_ratio_min": float(r_valid.min()),
        }
    weights, own = importance_weights_of(spec, log_ratio, valid)
    return weights, metrics | own


@torch.no_grad()
def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    mask: torch.Tensor,
    spec: RolloutCorrection,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``mask`` (``[B, T]``, its dtype) less the tokens ``spec``'s ``rollout_rs`` rejects
    (``mask`` itself without one), and the mask's metrics (``rs_rejected_frac``,
    ``rs_rejected_seq_frac``; none without one)."""
    log_ratio, valid = _log_ratio(old_logprobs, rollout_logprobs, mask)
    keep, metrics = rejection_mask_of(spec, log_ratio, valid)
    return torch.where(keep, mask, torch.zeros_like(mask)), metrics
