"""Loss aggregation: ``algorithm.loss_agg_mode`` (the registry
:data:`~trainer.algorithms.LOSS_AGG_MODES`), how a ``[B, T]`` matrix of per-token losses
becomes the scalar that is differentiated. Pure torch.

Exact under micro-batches, mini-batches and data parallel: every micro-batch of every rank
divides by the counts of the whole mini-batch (:class:`BatchCounts`, computed once by the loop
from the mini-batch's mask), so the gradients summed over micro-batches and ranks equal one
call's over the whole mini-batch. With ``n_i`` the trained tokens of sequence ``i``, ``N`` all
of the mini-batch's, ``S`` its sequences with at least one trained token and ``l_it`` a token's
loss:

- ``token-mean``: ``sum_i sum_t l_it / N`` (DAPO; verl's and SkyRL's default): each token
  weighs the same, long answers as much as short ones per token.
- ``seq-mean-token-sum``: ``sum_i sum_t l_it / S``.
- ``seq-mean-token-mean``: ``sum_i (sum_t l_it / n_i) / S`` (the original GRPO): each
  sequence weighs the same, so a token of a short answer weighs more.
- ``seq-mean-token-sum-norm``: ``sum_i sum_t l_it / (S * L)`` with a constant ``L``
  (``scale_factor``; Dr. GRPO, Liu et al. 2025: the generation budget), no length bias. As
  SkyRL's ``seq_mean_token_sum_norm`` and verl's mode of that name (both divide by ``S``).
- ``token-sum``: ``sum_i sum_t l_it`` (verl's ``token-sum``): no normalization at all, so the
  loss and its gradient grow with the mini-batch's tokens; pair it with a smaller learning
  rate.
"""

from __future__ import annotations

import attrs
import torch

from trainer.algorithms._ops import valid_mask
from trainer.algorithms._registry import LOSS_AGG_MODES

__all__ = [
    "BatchCounts",
    "aggregate",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "token_mean",
    "token_sum",
]


@attrs.frozen
class BatchCounts:
    """The counts of a whole mini-batch that each of its micro-batches, on every rank,
    normalizes by: its trained tokens and its sequences with at least one."""

    tokens: int
    sequences: int

    @classmethod
    def of(cls, mask: torch.Tensor) -> BatchCounts:
        """The counts of the ``[B, T]`` ``mask`` (nonzero: a trained token)."""
        valid = mask != 0
        return cls(int(valid.sum()), int(valid.any(dim=-1).sum()))


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    counts: BatchCounts | None = None,
    *,
    scale_factor: float | None = None,
) -> torch.Tensor:
    """The scalar of ``per_token`` (``[B, T]``) over its trained tokens by ``mode``.

    ``counts``: those of the whole mini-batch this call is a part of (default: this call's own,
    which is exact only when the call is the whole mini-batch). ``scale_factor``: the constant
    ``L`` of ``seq-mean-token-sum-norm``. Masked positions are zeroed first, so ``nan``/``inf``
    there cannot leak; with no trained token the result is ``0.0`` (still part of the graph).
    Raises ``ValueError`` for an unknown mode (naming the allowed ones), a mask that does not
    fit, or ``seq-mean-token-sum-norm`` without a positive ``scale_factor``.
    """
    fn = LOSS_AGG_MODES.get(mode)
    valid = valid_mask(per_token, mask)
    if counts is None:
        counts = BatchCounts.of(valid)
    picked = torch.where(valid, per_token, torch.zeros((), dtype=per_token.dtype))
    return fn(picked, valid, counts, scale_factor)


def token_mean(
    picked: torch.Tensor, valid: torch.Tensor, counts: BatchCounts, scale_factor: float | None
) -> torch.Tensor:
    """``sum_i sum_t l_it / N``."""
    return picked.sum() / max(counts.tokens, 1)


def token_sum(
    picked: torch.Tensor, valid: torch.Tensor, counts: BatchCounts, scale_factor: float | None
) -> torch.Tensor:
    """``sum_i sum_t l_it`` (verl ``token-sum``): each micro-batch's own sum, so the sums
    over micro-batches and ranks are the mini-batch's without any count."""
    return picked.sum()


def seq_mean_token_sum(
    picked: torch.Tensor, valid: torch.Tensor, counts: BatchCounts, scale_factor: float | None
) -> torch.Tensor:
    """``sum_i sum_t l_it / S``."""
    return picked.sum() / max(counts.sequences, 1)


def seq_mean_token_mean(
    picked: torch.Tensor, valid: torch.Tensor, counts: BatchCounts, scale_factor: float | None
) -> torch.Tensor:
    """``sum_i (sum_t l_it / n_i) / S``."""
    per_sequence = picked.sum(dim=-1) / valid.sum(dim=-1).clamp(min=1).to(picked.dtype)
    return per_sequence.sum() / max(counts.sequences, 1)


def seq_mean_token_sum_norm(
    picked: torch.Tensor, valid: torch.Tensor, counts: BatchCounts, scale_factor: float | None
) -> torch.Tensor:
    """``sum_i sum_t l_it / (S * L)``, ``L = scale_factor``."""
    if scale_factor is None or scale_factor <= 0:
        raise ValueError(
            "loss_agg_mode 'seq-mean-token-sum-norm' divides by a constant length: pass "
            f"scale_factor > 0 (the generation budget), got {scale_factor}"
        )
    return picked.sum() / (max(counts.sequences, 1) * scale_factor)
