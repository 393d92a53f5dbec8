"""The tensor operations the algorithms share: masked reductions, token log-probabilities, the
sampling distribution's entropy and the KL estimators. Pure torch, no trio, no I/O.

``mask`` is ``[B, T]``, bool or 0/1: nonzero marks a token that is trained on (a response token
the policy produced); zero marks padding, prompt or tool-output tokens. Masked positions never
contribute to a loss, a metric or a gradient, whatever values (even ``nan`` or ``inf``) they
hold.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.utils.checkpoint import checkpoint

__all__ = [
    "K3_CLAMP",
    "KL_ESTIMATORS",
    "LOG_RATIO_CLAMP",
    "entropy_of_logits",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "token_entropy",
    "token_logprobs",
    "valid_mask",
]

KLEstimator = Literal["k1", "k2", "k3", "abs"]

#: The allowed values of ``kl_penalty(kind=...)``.
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3", "abs")
#: Log-ratios are clamped to this range before ``exp`` so one wild token cannot overflow to
#: ``inf`` (and ``inf * 0`` to ``nan``); the same bound verl uses. ``exp(20)`` ~ 5e8 is far
#: beyond any clip range, so the clamp never changes a clipped loss.
LOG_RATIO_CLAMP = 20.0
#: ``k3`` is clamped to ``[-K3_CLAMP, K3_CLAMP]`` (as in verl): for a token the reference finds
#: far likelier than the policy, ``exp(ref - logp)`` explodes and would dominate the batch.
K3_CLAMP = 10.0


# --------------------------------------------------------------------------- reductions


def valid_mask(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``mask != 0`` as a bool tensor of ``x``'s shape and device (``ValueError`` if it cannot be
    broadcast to ``x``)."""
    if mask.shape != x.shape:
        try:
            mask = mask.expand_as(x)
        except RuntimeError:
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not match values of shape {tuple(x.shape)}"
            ) from None
    return mask.to(device=x.device) != 0


def masked_sum(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Sum of ``x`` over positions where ``mask`` is nonzero (over ``dim``, or everything).

    Masked positions are replaced by zero *before* summing (``torch.where``, not ``x * mask``),
    so ``nan``/``inf`` there neither leak into the sum nor produce ``nan`` gradients.
    Raises ``ValueError`` if ``mask`` cannot be broadcast to ``x``'s shape.
    """
    valid = valid_mask(x, mask)
    picked = torch.where(valid, x, torch.zeros((), dtype=x.dtype, device=x.device))
    return picked.sum() if dim is None else picked.sum(dim=dim)


def masked_mean(
    x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None
) -> torch.Tensor:
    """Mean of ``x`` over positions where ``mask`` is nonzero (over ``dim``, or everything).

    A slice with no valid position has mean ``0.0`` (not ``nan``): an all-padding micro-batch
    must not poison a step. Raises ``ValueError`` if ``mask`` cannot be broadcast to ``x``.
    """
    valid = valid_mask(x, mask)
    count = valid.sum() if dim is None else valid.sum(dim=dim)
    return masked_sum(x, valid, dim) / count.clamp(min=1).to(x.dtype)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLEstimator = "k3"
) -> torch.Tensor:
    """Per-token estimate of ``KL(policy || reference)`` from sampled tokens' log-probs.

    With ``d = logprobs - ref_logprobs`` (tokens sampled from the policy):

    - ``"k1"``: ``d`` — unbiased, high variance, can be negative per token.
    - ``"k2"``: ``d**2 / 2`` — low variance, biased.
    - ``"k3"``: ``exp(-d) + d - 1`` (= ``exp(ref - logp) - (ref - logp) - 1``) — unbiased,
      low variance, never negative. As in verl, ``ref - logp`` is clamped to ``[-20, 20]``
      before ``exp`` and the result to ``[-K3_CLAMP, K3_CLAMP]`` so one token the reference
      finds far likelier cannot dominate the batch.
    - ``"abs"``: ``|d|``.

    Returns a tensor of ``logprobs``' shape; reduce it with ``masked_mean``/``masked_sum``.
    Gradients flow to ``logprobs`` only. Raises ``ValueError`` for an unknown ``kind``
    (naming the allowed ones) or mismatched shapes.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; allowed: {', '.join(KL_ESTIMATORS)}")
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} "
            "must have one shape"
        )
    d = logprobs - ref_logprobs.detach()
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return d.abs()
    log_r = (-d).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Log-probability of each of ``token_ids`` under ``softmax(logits / temperature)``.

    ``logits`` is ``[..., V]`` and ``token_ids`` ``[...]`` (the same leading shape); the
    result has ``token_ids``' shape. Use the sampler's temperature, or the logprobs will not
    match the rollout's.

    Memory: for float32/float64 logits this is ``gather - logsumexp`` and never materializes
    a ``[..., V]`` log-softmax; half-precision logits are upcast to float32 one row of the
    leading dimension at a time, so peak extra memory is one row's ``[T, V]`` in float32,
    not the whole batch's.

    Raises ``ValueError`` for ``temperature <= 0`` or shapes that do not line up, and
    ``IndexError`` (from torch) for a token id outside ``[0, V)``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.shape[:-1] != token_ids.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} must be token_ids' shape {tuple(token_ids.shape)} "
            "plus a vocabulary dimension"
        )
    ids = token_ids.long().unsqueeze(-1)

    def rows(lg: torch.Tensor, ix: torch.Tensor) -> torch.Tensor:
        if temperature != 1.0:
            lg = lg / temperature
        picked = lg.gather(-1, ix).squeeze(-1)
        return picked - torch.logsumexp(lg, dim=-1)

    if logits.dtype in (torch.float32, torch.float64):
        return rows(logits, ids)
    if logits.dim() == 1:
        return rows(logits.float(), ids)
    return torch.stack([rows(lg.float(), ix) for lg, ix in zip(logits, ids)])


def entropy_of_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """The entropy of ``softmax(logits / temperature)`` over the last dimension, float32:
    ``logsumexp(z) - sum softmax(z) z`` with ``z = logits / temperature`` (one ``[..., V]``
    softmax, no log-softmax copy). Differentiable."""
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Each position's entropy of the whole sampling distribution ``softmax(logits /
    temperature)`` (verl's ``entropy_from_logits``, taken at the sampler's temperature as
    verl's actor takes it), float32, ``logits``' shape without the vocabulary dimension.

    Memory: one row of the leading dimension at a time (``[T, V]`` float32), and under autograd
    each row is checkpointed, so the backward keeps the logits (already held) and no
    ``[B, T, V]`` softmax. Raises ``ValueError`` for ``temperature <= 0``.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if logits.dim() == 1:
        return entropy_of_logits(logits, temperature)
    rows = []
    for row in logits:
        if torch.is_grad_enabled() and row.requires_grad:
            rows.append(checkpoint(entropy_of_logits, row, temperature, use_reentrant=False))
        else:
            rows.append(entropy_of_logits(row, temperature))
    return torch.stack(rows)  # type: ignore[arg-type]  # checkpoint returns the function's tensor
