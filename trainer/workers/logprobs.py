"""The policy's and the reference's log-probabilities of a batch's sampled tokens, at its
trained positions only (``loss_mask`` nonzero; ``0.0`` elsewhere), ``[B, L - 1]`` float32.

A causal LM whose structure is recognised (:func:`fused_head`: a ``.model`` body and a linear
``lm_head``, no logit transform after the head, not FSDP2-sharded) runs its body for the hidden
states, and the head is applied to the trained positions only, in chunks fused with the
log-softmax (:func:`trainer.algorithms.head_token_logprobs`): no ``[B, L, V]`` logits tensor,
in the forward or the backward. Any other model (and a sharded one, whose root parameters are
gathered only by its own ``forward``) takes the wrapper's full logits, as before; the numbers
are the same either way, to float rounding.
"""

from __future__ import annotations

import torch

from trainer import algorithms
from trainer.workers.batch import TrainBatch
from trainer.workers.fsdp import is_sharded

__all__ = ["LOGIT_TRANSFORMS", "forward_logprobs", "forward_logprobs_entropy", "fused_head"]

#: Config attributes of architectures that transform the logits after the head (Gemma 2's
#: soft-capping, Cohere's and Granite's scaling): set, the head is not fused.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def fused_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Linear] | None:
    """``(body, lm_head)`` of a causal LM whose logits are ``lm_head(body(...).last_hidden_state)``
    and nothing more, or None: no ``.model`` body, no linear ``lm_head`` that is the model's
    output embedding, a logit transform in its config (:data:`LOGIT_TRANSFORMS`), or FSDP2
    shards (the root's parameters are gathered by its forward only). A peft model (LoRA) is
    looked through to the model it wraps, whose layers run the adapter."""
    get_base_model = getattr(model, "get_base_model", None)
    inner = get_base_model() if callable(get_base_model) else model
    model = inner if isinstance(inner, torch.nn.Module) else model
    body, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(body, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
        return None
    output_embeddings = getattr(model, "get_output_embeddings", lambda: None)()
    config = getattr(model, "config", None)
    if output_embeddings is not head or is_sharded(model):
        return None
    if any(getattr(config, key, None) is not None for key in LOGIT_TRANSFORMS):
        return None
    return body, head


def forward_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Float32 logprob of each trained next token under ``softmax(logits / temperature)``,
    ``[B, L - 1]`` on the batch's device, ``0.0`` where ``loss_mask`` is 0. Differentiable;
    a batch without a trained token still gives a result in the graph (zero gradient), so its
    backward runs as any other's."""
    return _forward(model, batch, temperature, entropy=False)[0]


def forward_logprobs_entropy(
    model: torch.nn.Module, batch: TrainBatch, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`forward_logprobs` and each trained position's entropy of the whole sampling
    distribution (``[B, L - 1]``, ``0.0`` elsewhere; the entropy bonus's input), from the same
    logits: the fused head's chunks, or the full logits one sequence at a time
    (:func:`trainer.algorithms.token_entropy`). Both differentiable."""
    logprobs, entropy = _forward(model, batch, temperature, entropy=True)
    assert entropy is not None
    return logprobs, entropy


def _forward(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, *, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    trained = batch.loss_mask != 0
    fused = fused_head(model)
    if fused is None:
        logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        shifted = logits[:, :-1, :]
        full = algorithms.token_logprobs(shifted, batch.input_ids[:, 1:], temperature)
        zero = torch.zeros((), device=full.device)
        ent = None
        if entropy:
            ent = torch.where(trained, algorithms.token_entropy(shifted, temperature), zero)
        return torch.where(trained, full.float(), zero), ent
    body, head = fused
    out = body(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    hidden = out.last_hidden_state
    rows, cols = trained.nonzero(as_tuple=True)
    args = (hidden[rows, cols], head.weight, batch.input_ids[rows, cols + 1], temperature)
    zeros = hidden[:, :-1, 0].float() * 0.0  # in the graph even with nothing picked
    if not entropy:
        picked = algorithms.head_token_logprobs(*args, head_bias=head.bias)
        return zeros.index_put((rows, cols), picked), None
    picked, ent = algorithms.head_token_logprobs_entropy(*args, head_bias=head.bias)
    return zeros.index_put((rows, cols), picked), zeros.index_put((rows, cols), ent)
