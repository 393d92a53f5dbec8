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

Usage in a worker::

    weights, metrics = importance_weights(old_logp, rollout_logp, mask, "tis", cap=2.0)
    loss, _ = policy_loss(logp, old_logp, adv, mask, token_weights=weights)
"""

from __future__ import annotations

import torch

from trainer.algorithms import LOG_RATIO_CLAMP, OFF_POLICY_CORRECTIONS, OffPolicyCorrection

__all__ = [
    "DEFAULT_TIS_CAP",
    "IS_RATIO_METRICS",
    "OFF_POLICY_CORRECTIONS",
    "OffPolicyCorrection",
    "importance_weights",
]

#: The default truncation of the importance weight (``algorithm.tis_cap``), as in verl's
#: ``tis_imp_ratio_cap`` examples.
DEFAULT_TIS_CAP = 2.0
#: The metrics ``importance_weights`` returns with correction ``"none"``; ``"tis"`` adds
#: ``is_truncated_frac``.
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
    a cap). In a synchronous run the engine samples with the trained weights, so the ratio
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
    with torch.no_grad():
        valid = mask.to(device=old_logprobs.device) != 0
        zero = torch.zeros((), dtype=old_logprobs.dtype, device=old_logprobs.device)
        log_ratio = torch.where(valid, old_logprobs - rollout_logprobs.to(old_logprobs), zero)
        ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        n_valid = int(valid.sum())
        names = IS_RATIO_METRICS + (("is_truncated_frac",) if correction == "tis" else ())
        if n_valid == 0:
            metrics = dict.fromkeys(names, 0.0)
        else:
            r_valid = ratio[valid]
            metrics = {
                "is_ratio_mean": float(r_valid.mean()),
                "is_ratio_max": float(r_valid.max()),
                "is_ratio_min": float(r_valid.min()),
            }
        if correction == "none":
            return None, metrics
        truncated = valid & (ratio > cap) if cap is not None else torch.zeros_like(valid)
        if n_valid:
            metrics["is_truncated_frac"] = float(truncated.sum()) / n_valid
        weights = ratio if cap is None else ratio.clamp(max=cap)
        return torch.where(valid, weights, zero), metrics
