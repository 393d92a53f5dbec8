"""Token log-probabilities fused with the LM head, in chunks of positions: the sampled tokens'
logprobs without a ``[N, V]`` logits tensor for all ``N`` positions at once. Pure torch.

A causal LM's logits are ``hidden @ W.T (+ b)``; the logprob of token ``y`` at a position is
``z_y / tau - logsumexp(z / tau)``, which needs the whole vocabulary row but nothing of the
other positions. :func:`head_token_logprobs` computes that for ``chunk_rows`` positions at a
time, and under autograd each chunk is checkpointed: its logits are freed after its forward and
recomputed in its backward, so the forward and the backward each hold one chunk's ``[C, V]``
float32 logits (and its gradient), never the whole micro-batch's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from trainer.algorithms._ops import entropy_of_logits, token_logprobs

__all__ = ["LOGPROB_CHUNK_ELEMENTS", "head_token_logprobs", "head_token_logprobs_entropy"]

#: The logits one chunk holds, ``rows * V`` elements (2**24 float32: 64 MiB), unless the caller
#: says ``chunk_rows``: about 340 positions of a 49,152-token vocabulary.
LOGPROB_CHUNK_ELEMENTS = 2**24


def head_token_logprobs(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    head_bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> torch.Tensor:
    """Float32 log-probability of each of ``token_ids`` (``[N]``) under
    ``softmax((hidden @ head_weight.T + head_bias) / temperature)``, ``hidden`` ``[N, H]``.

    The same numbers as ``token_logprobs(lm_head(hidden), token_ids, temperature)`` up to float
    rounding (the logits are taken in ``hidden``'s dtype, then upcast to float32, as there);
    gradients flow to ``hidden``, ``head_weight`` and ``head_bias``. ``chunk_rows``: positions
    per chunk (default: :data:`LOGPROB_CHUNK_ELEMENTS` over the vocabulary size). Raises
    ``ValueError`` for ``temperature <= 0`` or shapes that do not line up.
    """
    return _chunked(_chunk, hidden, head_weight, head_bias, token_ids, temperature, chunk_rows)[0]


def head_token_logprobs_entropy(
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    token_ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    head_bias: torch.Tensor | None = None,
    chunk_rows: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_token_logprobs` and, from the same chunk's logits, each position's entropy
    of the whole distribution (``[N]`` float32 both; the entropy as
    :func:`trainer.algorithms._ops.entropy_of_logits`): the entropy bonus's input at the cost
    of one softmax per chunk, no further ``[N, V]`` tensor. Both differentiable."""
    return _chunked(  # type: ignore[return-value]
        _chunk_entropy, hidden, head_weight, head_bias, token_ids, temperature, chunk_rows
    )


def _chunked(
    fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
    hidden: torch.Tensor,
    head_weight: torch.Tensor,
    head_bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
    chunk_rows: int | None,
) -> tuple[torch.Tensor, ...]:
    """``fn``'s tensors over the positions, chunk by chunk (each checkpointed under
    autograd), concatenated."""
    if hidden.dim() != 2 or token_ids.shape != hidden.shape[:1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} must be [N, H] and token_ids {tuple(token_ids.shape)} [N]"
        )
    rows = chunk_rows or max(1, LOGPROB_CHUNK_ELEMENTS // head_weight.shape[0])
    parts: list[tuple[torch.Tensor, ...]] = []
    for start in range(0, hidden.shape[0], rows):
        h, ids = hidden[start : start + rows], token_ids[start : start + rows]
        if torch.is_grad_enabled():
            out = checkpoint(fn, h, head_weight, head_bias, ids, temperature, use_reentrant=False)
        else:
            out = fn(h, head_weight, head_bias, ids, temperature)
        parts.append(out if isinstance(out, tuple) else (out,))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty)
    return tuple(torch.cat(column) for column in zip(*parts))


def _chunk_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    return token_logprobs(logits, token_ids, temperature), entropy_of_logits(logits, temperature)


def _chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    token_ids: torch.Tensor,
    temperature: float,
) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    return token_logprobs(logits.float(), token_ids, temperature)
