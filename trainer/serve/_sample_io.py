"""A sample's request and answer: the SDK's ``SampleRequest`` (JSON) read into the engine's
:class:`~engines.types.SamplingParams`, and the completions written as the protobuf
``SampleResponse`` that ``/api/v1/retrieve_future`` answers, by hand, as
:mod:`trainer.serve._proto` writes ``ForwardBackwardOutput``.

The SDK (``tinker==0.38.0``) accepts a ``SampleResponse`` only as protobuf (its
``PROTO_SUPPORTED_TYPES``). Field numbers from its descriptor
(``tinker/proto/tinker_public_pb2.py``): ``SampleResponse`` 1 ``sequences`` (repeated
``SampledSequence``), 2 ``prompt_logprobs`` (float32 bytes, NaN where none), 3
``topk_prompt_logprobs`` (``TopkLogprobs``: 1 int32 ``token_ids`` and 2 float32 ``logprobs``,
both ``[length, k]`` row-major, 3 ``k``, 4 ``length``; an empty slot is token 0 at
:data:`MASK_LOGPROB`); ``SampledSequence`` 1 ``stop_reason`` (enum: 0 stop, 1 length), 2
``tokens`` (int32 bytes), 3 ``logprobs`` (float32 bytes).

Prompt logprobs are the model's own (the raw logits, whatever the temperature, as vLLM's),
one per prompt token, none for the first; ``prompt_logprobs_last_n`` keeps the last N.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np

from engines.types import Completion, SamplingParams
from trainer.serve._proto import put_field, put_varint_field

__all__ = [
    "DEFAULT_MAX_TOKENS",
    "MASK_LOGPROB",
    "NOT_SERVED_OFF",
    "STOP_REASONS",
    "SampleAsk",
    "encode_sample_response",
    "read_sample_request",
]

#: ``tinker_public.StopReason`` by the SDK's name.
STOP_REASONS = {"stop": 0, "length": 1}
#: The SDK's empty top-k slot (``tinker.types.topk_logprobs.MASK_LOGPROB``).
MASK_LOGPROB = -99999.0
#: ``max_tokens`` of a request that sets none (vLLM's default for completions).
DEFAULT_MAX_TOKENS = 16
#: ``SampleRequest`` fields this service does not serve, with the values meaning "off".
NOT_SERVED_OFF: dict[str, tuple[object, ...]] = {
    "topk_sample_logprobs": (None, 0),
    "target_prompt_logprobs": (None,),
    "prompt_alt_tokens_k": (None, 0),
    "record_stability_info": (None, False),
}


@attrs.frozen
class SampleAsk:
    """What one ``SampleRequest`` asks: its prompt, its sampling and its prompt logprobs."""

    prompt: list[int]
    params: SamplingParams
    #: ``prompt_logprobs``: each prompt token's logprob.
    prompt_logprobs: bool = False
    #: ``topk_prompt_logprobs``: the k best at each prompt position (0: none).
    topk: int = 0
    #: ``prompt_logprobs_last_n``: score the last N prompt tokens only (None: all).
    last_n: int | None = None


def read_sample_request(body: dict[str, Any]) -> SampleAsk:
    """A ``SampleRequest``'s prompt, sampling and prompt logprobs; ``ValueError`` saying what
    is wrong or not served, one sentence."""
    for field, off in NOT_SERVED_OFF.items():
        if body.get(field) not in off:
            raise ValueError(f"{field} is not served by this service yet (docs/tinker.md)")
    prompt = _prompt(body.get("prompt"))
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise ValueError("sampling_params must be an object")
    top_k = sp.get("top_k", -1)
    if top_k not in (-1, 0, None):
        raise ValueError(f"top_k={top_k} is not served (the reference engine samples without it)")
    include = bool(body.get("prompt_logprobs"))
    topk = body.get("topk_prompt_logprobs") or 0
    last_n = body.get("prompt_logprobs_last_n")
    if not _is_int(topk) or topk < 0:
        raise ValueError(f"topk_prompt_logprobs must be 0 or more, not {topk!r}")
    if last_n is not None and (not _is_int(last_n) or not 1 <= last_n < len(prompt)):
        raise ValueError(f"prompt_logprobs_last_n must be in [1, {len(prompt) - 1}]: {last_n!r}")
    max_tokens, seed = sp.get("max_tokens"), sp.get("seed")
    try:
        params = SamplingParams(
            temperature=float(sp.get("temperature", 1.0)),
            top_p=float(sp.get("top_p", 1.0)),
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else int(max_tokens),
            seed=None if seed is None else int(seed),
            prompt_logprobs=topk if include or topk else None,
            **_stop(sp.get("stop")),
        )
    except (TypeError, ValueError):
        raise ValueError(f"sampling_params {json.dumps(sp)[:200]} are not numbers") from None
    return SampleAsk(prompt, params, include, topk, last_n)


def _prompt(model_input: object) -> list[int]:
    chunks = model_input.get("chunks") if isinstance(model_input, dict) else None
    if not isinstance(chunks, list):
        raise ValueError("prompt must be a ModelInput (chunks)")
    prompt: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            kind = chunk.get("type") if isinstance(chunk, dict) else chunk
            raise ValueError(f"a prompt chunk of type {kind!r}: only token chunks are served")
        tokens = chunk.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise ValueError("a prompt chunk's tokens must be integers")
        prompt.extend(tokens)
    if not prompt:
        raise ValueError("the prompt has no tokens")
    return prompt


def _stop(stop: object) -> dict[str, Any]:
    """The SDK's ``stop``: None, EOS alone; ``[]``, not even EOS; strings or token ids (each
    kept in the sample, as EOS is)."""
    if stop is None:
        return {}
    if isinstance(stop, str):
        return {"stop": (stop,)}
    if isinstance(stop, list):
        if not stop:
            return {"ignore_eos": True}
        if all(isinstance(s, str) for s in stop):
            return {"stop": tuple(stop)}
        if all(_is_int(s) for s in stop):
            return {"stop_token_ids": tuple(stop)}
    raise ValueError("stop must be a string, a list of strings or a list of token ids")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- the answer -----------------------------------------------------------------------------------


def encode_sample_response(ask: SampleAsk, completions: Sequence[Completion]) -> bytes:
    """A ``SampleResponse`` of ``completions`` (each ``stop`` or ``length``), with the prompt
    logprobs ``ask`` asked for (the first completion's: every sample shares the prompt)."""
    out = b""
    for c in completions:
        body = put_varint_field(1, STOP_REASONS[c.finish_reason])
        body += put_field(2, np.asarray(c.token_ids, dtype="<i4").tobytes())
        body += put_field(3, np.asarray(c.logprobs, dtype="<f4").tobytes())
        out += put_field(1, body)
    if ask.params.prompt_logprobs is None or not completions:
        return out
    scores = list(completions[0].prompt_logprobs)
    if len(scores) != len(ask.prompt):
        raise ValueError(f"{len(scores)} prompt logprobs for a prompt of {len(ask.prompt)}")
    if ask.last_n is not None:
        scores = [None] * (len(scores) - ask.last_n) + scores[-ask.last_n :]
    if ask.prompt_logprobs:
        values = [np.nan if s is None else s.logprob for s in scores]
        out += put_field(2, np.asarray(values, dtype="<f4").tobytes())
    if ask.topk:
        ids = np.zeros((len(scores), ask.topk), dtype="<i4")
        lps = np.full((len(scores), ask.topk), MASK_LOGPROB, dtype="<f4")
        for i, s in enumerate(scores):
            for j, (tok, lp) in enumerate(s.top[: ask.topk] if s is not None else []):
                ids[i, j], lps[i, j] = tok, lp
        topk = put_field(1, ids.tobytes()) + put_field(2, lps.tobytes())
        topk += put_varint_field(3, ask.topk) + put_varint_field(4, len(scores))
        out += put_field(3, topk)
    return out
