"""One decode step of the reference engine: batched forward passes with a per-request KV cache.

Each request keeps its own KV cache (one ``(keys, values)`` pair per layer, shaped
``[kv_heads, length, head_dim]``) covering every token of ``prompt + output`` except the
last one, which the next step feeds. A step runs up to two forward passes (pure functions of
the requests, run in a worker thread by the engine):

- *prefill* for requests without a cache (new ones, or ones whose cache was dropped by a
  sleep or a weight load): their whole sequence, left-padded;
- *decode* for the others: one token each, over their caches left-padded to a common length.

Positions are passed explicitly, so padding never shifts a token's rotary position: batched
results equal per-request ones up to floating-point noise.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, Protocol, cast

import torch
from transformers import DynamicCache

from engines.types import SamplingParams

__all__ = ["DecodeRequest", "KVCache", "decode_step", "sample_token"]

#: One ``(keys, values)`` pair per layer, each ``[kv_heads, length, head_dim]``.
KVCache = list[tuple[torch.Tensor, torch.Tensor]]


class DecodeRequest(Protocol):
    """What a decode step reads and updates on a request."""

    prompt_ids: list[int]
    out_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    kv: KVCache | None


def sample_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Sample from one row of logits with temperature and top-p (temperature 0: greedy)."""
    if params.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep a token if the mass before it is below top_p (the top token is always kept)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.x names the cache argument ``cache`` (``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cast(Any, cache.layers)]


def _prefill(model: Any, reqs: Sequence[DecodeRequest], pad_id: int) -> torch.Tensor:
    seqs = [r.prompt_ids + r.out_ids for r in reqs]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        logits_to_keep=1,
        **{_cache_kwarg(model): cache},
    )
    for i, (r, s) in enumerate(zip(reqs, seqs)):
        start = width - len(s)
        r.kv = [(k[i, :, start:], v[i, :, start:]) for k, v in _layers(cache)]
    return out.logits[:, -1, :].float()


def _decode(model: Any, reqs: Sequence[DecodeRequest]) -> torch.Tensor:
    lengths = [r.kv[0][0].shape[1] for r in reqs]  # type: ignore[index]
    past = max(lengths)
    layers: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in range(len(reqs[0].kv)):  # type: ignore[arg-type]
        k0, v0 = reqs[0].kv[layer]  # type: ignore[index]
        keys = k0.new_zeros((len(reqs), k0.shape[0], past, k0.shape[2]))
        values = v0.new_zeros((len(reqs), v0.shape[0], past, v0.shape[2]))
        for i, r in enumerate(reqs):
            k, v = r.kv[layer]  # type: ignore[index]
            keys[i, :, past - lengths[i] :] = k
            values[i, :, past - lengths[i] :] = v
        layers.append((keys, values))
    mask = torch.zeros((len(reqs), past + 1), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, past - n :] = 1
    ids = torch.tensor([[(r.prompt_ids + r.out_ids)[-1]] for r in reqs], dtype=torch.long)
    positions = torch.tensor([[n] for n in lengths], dtype=torch.long)
    cache = DynamicCache(ddp_cache_data=layers, config=model.config)
    out = model(
        input_ids=ids,
        attention_mask=mask,
        position_ids=positions,
        use_cache=True,
        **{_cache_kwarg(model): cache},
    )
    for i, r in enumerate(reqs):
        start = past - lengths[i]
        r.kv = [(k[i, :, start:], v[i, :, start:]) for k, v in _layers(cache)]
    return out.logits[:, -1, :].float()


@torch.no_grad()
def decode_step(
    model: Any, batch: Sequence[DecodeRequest], pad_id: int
) -> tuple[list[int], list[float]]:
    """Advance every request of ``batch`` by one sampled token; returns (tokens, logprobs).

    Logprobs are of the raw logits (before temperature/top-p), as vLLM reports them. Each
    request's ``kv`` is replaced; the caller appends the token to ``out_ids``.
    """
    logits: dict[int, torch.Tensor] = {}
    fresh = [r for r in batch if r.kv is None]
    cached = [r for r in batch if r.kv is not None]
    if fresh:
        for r, row in zip(fresh, _prefill(model, fresh, pad_id)):
            logits[id(r)] = row
    if cached:
        for r, row in zip(cached, _decode(model, cached)):
            logits[id(r)] = row
    rows = torch.stack([logits[id(r)] for r in batch])
    tokens = [sample_token(row, r.params, r.generator) for row, r in zip(rows, batch)]
    picked = torch.log_softmax(rows, dim=-1)[torch.arange(len(batch)), torch.tensor(tokens)]
    return tokens, picked.tolist()
