"""The critic's loss and its diagnostics (PPO with a value function: ``algorithm.advantage_estimator=gae``).
Pure torch.
"""

from __future__ import annotations

import torch

from trainer.algorithms._aggregation import BatchCounts, aggregate
from trainer.algorithms._ops import masked_mean, valid_mask

__all__ = ["VALUE_LOSS_METRICS", "explained_variance", "value_loss"]

#: The metrics :func:`value_loss` returns (the worker logs them as ``critic/<name>``).
VALUE_LOSS_METRICS = ("vf_loss", "vf_clip_frac", "vpred_mean")


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip: float | None,
    counts: BatchCounts | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (Schulman et al. 2017; verl ``compute_value_loss``, SkyRL's
    ``value_clip``): with ``v`` the critic's prediction, ``v_old`` its value when the batch was
    scored and ``R`` the GAE return,
    ``0.5 * max((v - R)^2, (v_old + clip(v - v_old, -clip, clip) - R)^2)`` per trained token,
    averaged over the mini-batch's trained tokens (``token-mean`` by ``counts``, exact under
    micro-batches and data parallel). ``clip`` None: ``0.5 * (v - R)^2``.

    Metrics: ``vf_loss`` (this call's share of the loss), ``vf_clip_frac`` (the trained tokens
    whose clipped term is the larger, as verl) and ``vpred_mean`` (the mean prediction), both
    over this call's tokens.
    """
    valid = valid_mask(values, mask)
    unclipped = (values - returns) ** 2
    if clip is None:
        per_token, clipped_frac = unclipped, torch.zeros(())
    else:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        clipped = (clipped_values - returns) ** 2
        per_token = torch.maximum(unclipped, clipped)
        clipped_frac = masked_mean((clipped > unclipped).float(), valid)
    loss = 0.5 * aggregate(per_token, valid, "token-mean", counts)
    return loss, {
        "vf_loss": float(loss.detach()),
        "vf_clip_frac": float(clipped_frac),
        "vpred_mean": float(masked_mean(values.detach(), valid)),
    }


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """``1 - Var(R - v) / (Var(R) + 1e-5)`` over the trained tokens, as verl's
    ``critic/vf_explained_var``: near 1 for a critic that predicts every return, 0 for one no
    better than their mean, below 0 for a worse one; 0.0 with fewer than two trained tokens."""
    valid = valid_mask(values, mask)
    r, v = returns[valid].double(), values[valid].double()
    if r.numel() < 2:
        return 0.0
    return float(1.0 - (r - v).var() / (r.var() + 1e-5))
