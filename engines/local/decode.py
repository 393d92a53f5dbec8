"""One decode step of the reference engine: batched forward passes over packed KV caches.

A request's KV cache covers every token of ``prompt + output`` except the last one, which
the next step feeds. It lives in a :class:`PackedKV`: the keys and values of a batch of
rows, one ``[rows, kv_heads, width, head_dim]`` pair per layer, each row right-aligned (row
``i`` holds its ``lengths[i]`` tokens in the last positions; the rest is padding, masked
out). A request points at its row with a :class:`KVRef`. A step runs up to two forward
passes (pure functions of the requests, run in a worker thread by the engine):

- *prefill* for requests without a cache (new ones, or ones whose cache was dropped by a
  sleep or a weight load): their whole sequences, left-padded. Identical sequences (the
  samples of one prompt) are computed once and their rows copied;
- *decode* for the others: one token each. When they are exactly the rows of one packed
  cache, in order (a batch decoding together, the common case), that cache is used as it
  is; otherwise their rows are gathered, one ``index_select`` per source cache and layer,
  and left-padded to a common width. The step's output cache is their new packed cache.

So a step costs a few tensor operations per layer whatever the batch size, not a few per
request. The model and the caches live on the model's device (CPU or CUDA); the step's
logits come back to the CPU, where sampling runs, so a seed draws the same tokens on either. Positions are passed explicitly, so padding never shifts a token's rotary
position: batched results equal per-request ones up to floating-point noise.

Sampling is batched too (:func:`sample_tokens`): temperature and top-p per row, then
``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from each request's own seeded
``torch.Generator`` (one draw per vocabulary entry), which is how ``torch.multinomial`` draws
one sample. So a seed gives the same tokens whatever else shares the batch, and the same as
``torch.multinomial(probs, 1, generator=...)`` would.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Sequence
from typing import Any, Protocol, cast

import attrs
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from engines.local.lora import Adapter, LoraLayers
from engines.types import PromptLogprob, SamplingParams

__all__ = [
    "LOGPROBS_MODES",
    "DecodeRequest",
    "KVRef",
    "PackedKV",
    "StepResult",
    "decode_step",
    "exponential_noise",
    "prompt_logprobs",
    "sample_tokens",
]

#: What a completion's logprobs are of (``--logprobs-mode``, vLLM's names): the model's raw
#: logits (vLLM's default), or the sampling distribution's (over the request's temperature).
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@attrs.frozen(eq=False)
class PackedKV:
    """Keys and values of a batch of rows, right-aligned; see the module docstring."""

    #: One ``(keys, values)`` pair per layer, each ``[rows, kv_heads, width, head_dim]``.
    layers: list[tuple[torch.Tensor, torch.Tensor]]
    #: Tokens each row holds (``[rows]``, long), in its last positions.
    lengths: torch.Tensor

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def width(self) -> int:
        return int(self.layers[0][0].shape[2])


@attrs.frozen(eq=False)
class KVRef:
    """A request's KV cache: row ``row`` of ``cache``."""

    cache: PackedKV
    row: int


class DecodeRequest(Protocol):
    """What a decode step reads and updates on a request."""

    prompt_ids: list[int]
    out_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    kv: KVRef | None
    #: The request's LoRA adapter (None: the base weights).
    adapter: Adapter | None
    #: Round its logits to bfloat16 first, as a bf16 engine computes them (a fault).
    bf16_logits: bool
    #: Its prompt's logprobs (``params.prompt_logprobs``), set by the prefill that first
    #: computes them; None until then.
    prompt_scores: list[PromptLogprob | None] | None


def sample_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], noise: torch.Tensor
) -> torch.Tensor:
    """One token per row of ``logits`` (``[rows, vocab]``), with each row's temperature and
    top-p (temperature 0: greedy): ``argmax(probs / noise)``, where ``noise`` (``[rows,
    vocab]``) holds independent ``Exp(1)`` draws (the exponential race: token ``i`` wins with
    probability ``probs[i]``). Returns ``[rows]`` token ids."""
    temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype)
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    probs = torch.softmax(logits / temperature.clamp(min=1e-6)[:, None], dim=-1)
    if bool((top_p < 1.0).any()):
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        # keep a token if the mass before it is below top_p (the top token is always kept)
        drop = (ordered.cumsum(dim=-1) - ordered) >= top_p[:, None]
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), 0.0)
    picked = (probs / noise).argmax(dim=-1)
    return torch.where(temperature <= 0, logits.argmax(dim=-1), picked)


def exponential_noise(generators: Sequence[torch.Generator | None], vocab: int) -> torch.Tensor:
    """``[rows, vocab]`` ``Exp(1)`` draws, row ``i`` from ``generators[i]`` (ones for None:
    greedy rows draw nothing)."""
    noise = torch.ones((len(generators), vocab))
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(1.0, generator=generator)
    return noise


def _cache_kwarg(model: Any) -> str:
    """transformers >= 5.x names the cache argument ``cache`` (``past_key_values`` before)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _device(model: Any) -> torch.device:
    return next(model.parameters()).device


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cast(Any, cache.layers)]


def _wants_prompt_scores(r: DecodeRequest) -> bool:
    return r.params.prompt_logprobs is not None and r.prompt_scores is None


def prompt_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], k: int, bf16: bool = False
) -> list[PromptLogprob | None]:
    """vLLM's prompt logprobs of ``prompt_ids`` from the logits at its positions (``[len,
    vocab]``, row ``i`` predicting token ``i + 1``; the last row is not read): None for the
    first token, then each token's logprob of the raw logits, its rank (how many tokens have
    a logprob at least its own) and the ``k`` best ``(id, logprob)``."""
    rows = logits[: len(prompt_ids) - 1].float().cpu()
    if bf16:
        rows = rows.bfloat16().float()
    logprobs = torch.log_softmax(rows, dim=-1)
    targets = torch.tensor(list(prompt_ids[1:]), dtype=torch.long)
    picked = logprobs.gather(1, targets[:, None])
    ranks = (logprobs >= picked).sum(dim=-1)
    tops = _top_alternatives(logprobs, [k] * len(targets)) if len(targets) else []
    scores: list[PromptLogprob | None] = [None]
    for i, (lp, rank) in enumerate(zip(picked.squeeze(1).tolist(), ranks.tolist())):
        scores.append(PromptLogprob(lp, int(rank), tops[i]))
    return scores


def _prefill(
    model: Any, reqs: Sequence[DecodeRequest], pad_id: int, lora: LoraLayers | None
) -> torch.Tensor:
    seqs = [tuple(r.prompt_ids + r.out_ids) for r in reqs]
    # prompt logprobs need every position's logits; a plain prefill only the last one's
    scored = any(_wants_prompt_scores(r) for r in reqs)
    # one row per distinct (adapter, tokens): the same tokens through two adapters differ
    index: dict[tuple[int, tuple[int, ...]], int] = {}
    distinct: list[tuple[int, ...]] = []
    adapters: list[Adapter | None] = []
    source = []
    for r, s in zip(reqs, seqs, strict=True):
        key = (id(r.adapter), s)
        if key not in index:
            index[key] = len(distinct)
            distinct.append(s)
            adapters.append(r.adapter)
        source.append(index[key])
    width = max(len(s) for s in distinct)
    ids = torch.full((len(distinct), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(distinct), width), dtype=torch.long)
    for i, s in enumerate(distinct):
        ids[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    device = _device(model)
    cache = DynamicCache(config=model.config)
    with _adapters(lora, adapters):
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=0 if scored else 1,
            **{_cache_kwarg(model): cache},
        )
    if scored:
        for r, row in zip(reqs, source, strict=True):
            if _wants_prompt_scores(r):
                start = width - len(distinct[row])
                r.prompt_scores = prompt_logprobs(
                    out.logits[row, start:],
                    r.prompt_ids,
                    cast(int, r.params.prompt_logprobs),
                    r.bf16_logits,
                )
    logits = out.logits[:, -1, :].float().cpu()
    del out
    layers = _layers(cache)
    if len(distinct) < len(seqs):  # copy the shared rows out to one row per request
        rows = torch.tensor(source)
        on_device = rows.to(device)
        layers = [(k.index_select(0, on_device), v.index_select(0, on_device)) for k, v in layers]
        logits = logits.index_select(0, rows)
    packed = PackedKV(layers, torch.tensor([len(s) for s in seqs]))
    for i, r in enumerate(reqs):
        r.kv = KVRef(packed, i)
    return logits


def _gather(reqs: Sequence[DecodeRequest]) -> PackedKV:
    """The packed cache of ``reqs``' rows, in order (see the module docstring)."""
    refs = [cast(KVRef, r.kv) for r in reqs]
    first = refs[0].cache
    if len(refs) == first.rows and all(
        ref.cache is first and ref.row == i for i, ref in enumerate(refs)
    ):
        return first
    sources: dict[int, tuple[PackedKV, list[int], list[int]]] = {}
    for position, ref in enumerate(refs):
        _, rows, positions = sources.setdefault(id(ref.cache), (ref.cache, [], []))
        rows.append(ref.row)
        positions.append(position)
    width = max(cache.width for cache, _, _ in sources.values())
    parts: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
    lengths: list[torch.Tensor] = []
    placed: list[int] = []
    device = first.layers[0][0].device
    for cache, rows, positions in sources.values():
        index = torch.tensor(rows)
        on_device = index.to(device)
        pad = (0, 0, width - cache.width, 0)  # left-pad the token axis
        parts.append(
            [
                (
                    F.pad(k.index_select(0, on_device), pad),
                    F.pad(v.index_select(0, on_device), pad),
                )
                for k, v in cache.layers
            ]
        )
        lengths.append(cache.lengths.index_select(0, index))
        placed += positions
    order = torch.empty(len(placed), dtype=torch.long)
    order[torch.tensor(placed)] = torch.arange(len(placed))  # row of each request in the cat
    order_on_device = order.to(device)
    layers = [
        (
            torch.cat([p[layer][0] for p in parts]).index_select(0, order_on_device),
            torch.cat([p[layer][1] for p in parts]).index_select(0, order_on_device),
        )
        for layer in range(len(first.layers))
    ]
    return PackedKV(layers, torch.cat(lengths).index_select(0, order))


def _adapters(
    lora: LoraLayers | None, adapters: Sequence[Adapter | None]
) -> contextlib.AbstractContextManager[None]:
    """The rows' adapters for the forward pass within (nothing without ``--enable-lora``)."""
    return lora.rows(adapters) if lora is not None else contextlib.nullcontext()


def _decode(model: Any, reqs: Sequence[DecodeRequest], lora: LoraLayers | None) -> torch.Tensor:
    packed = _gather(reqs)
    width = packed.width
    lengths = packed.lengths
    mask = (torch.arange(width + 1)[None, :] >= (width - lengths)[:, None]).long()
    ids = torch.tensor(
        [[r.out_ids[-1] if r.out_ids else r.prompt_ids[-1]] for r in reqs], dtype=torch.long
    )
    device = packed.layers[0][0].device
    cache = DynamicCache(ddp_cache_data=packed.layers, config=model.config)
    with _adapters(lora, [r.adapter for r in reqs]):
        out = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=lengths[:, None].to(device),
            use_cache=True,
            **{_cache_kwarg(model): cache},
        )
    grown = PackedKV(_layers(cache), lengths + 1)
    for i, r in enumerate(reqs):
        r.kv = KVRef(grown, i)
    return out.logits[:, -1, :].float().cpu()


@attrs.frozen
class StepResult:
    """What one decode step sampled, one entry per request of the batch, in order."""

    #: The sampled token ids.
    tokens: list[int]
    #: Each sampled token's logprob.
    logprobs: list[float]
    #: Each request's ``params.top_logprobs`` most likely ``(token id, logprob)``, best
    #: first (an empty list for a request that asked for none).
    top: list[list[tuple[int, float]]]


def _top_alternatives(
    logprobs: torch.Tensor, wanted: Sequence[int]
) -> list[list[tuple[int, float]]]:
    """The ``wanted[row]`` best ``(id, logprob)`` of each row: one ``topk`` for the batch."""
    k = min(max(wanted), logprobs.shape[-1])
    if k <= 0:
        return [[] for _ in wanted]
    values, ids = torch.topk(logprobs, k, dim=-1)
    return [list(zip(i[:n], v[:n])) for i, v, n in zip(ids.tolist(), values.tolist(), wanted)]


@torch.no_grad()
def decode_step(
    model: Any,
    batch: Sequence[DecodeRequest],
    pad_id: int,
    lora: LoraLayers | None = None,
    *,
    processed: bool = False,
) -> StepResult:
    """Advance every request of ``batch`` by one sampled token (each through its adapter,
    with ``lora``: :mod:`engines.local.lora`).

    Logprobs are of the raw logits (vLLM's default ``--logprobs-mode raw_logprobs``), or with
    ``processed`` of the logits over each request's temperature (``processed_logprobs``: the
    distribution the token was sampled from, before top-p, as the trainer computes its own;
    a greedy request's stay raw). The alternatives (``params.top_logprobs``) cost one
    ``topk`` over the batch, and nothing when no request asks for them. Each request's ``kv`` is replaced and its generator advanced
    (unless it samples greedily); the caller appends the token to ``out_ids``.
    """
    fresh = [i for i, r in enumerate(batch) if r.kv is None]
    cached = [i for i, r in enumerate(batch) if r.kv is not None]
    parts: list[torch.Tensor] = []
    if fresh:
        parts.append(_prefill(model, [batch[i] for i in fresh], pad_id, lora))
    if cached:
        parts.append(_decode(model, [batch[i] for i in cached], lora))
    rows = torch.cat(parts)
    if fresh and cached:  # back to the batch's order
        order = torch.empty(len(batch), dtype=torch.long)
        order[torch.tensor(fresh + cached)] = torch.arange(len(batch))
        rows = rows.index_select(0, order)
    rounded = [i for i, r in enumerate(batch) if r.bf16_logits]
    if rounded:  # the bf16_logits fault: those rows as a bfloat16 engine would have them
        at = torch.tensor(rounded)
        rows = rows.index_copy(0, at, rows.index_select(0, at).bfloat16().float())
    generators = [r.generator if r.params.temperature > 0 else None for r in batch]
    noise = exponential_noise(generators, rows.shape[-1])
    tokens = sample_tokens(rows, [r.params for r in batch], noise)
    if processed:
        temperature = torch.tensor([r.params.temperature for r in batch], dtype=rows.dtype)
        rows = rows / torch.where(temperature > 0, temperature, 1.0)[:, None]
    logprobs = torch.log_softmax(rows, dim=-1)
    picked = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return StepResult(
        tokens.tolist(),
        picked.tolist(),
        _top_alternatives(logprobs, [r.params.top_logprobs for r in batch]),
    )
