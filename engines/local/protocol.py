"""The ``/v1/completions`` route's request and response shapes (vLLM's OpenAI server).

Pure (no I/O): the server hands it a decoded body and gets back a :class:`CompletionRequest`
or a :class:`ProtocolError` (a 4xx with vLLM's error body, see :mod:`engines.local.validation`).
Bad input of any shape raises ``ProtocolError``, never another exception: the server treats
anything else as its own bug (a 5xx), and the tests hold that no input reaches that path.
The chat route is :mod:`engines.local.chat_protocol`; streamed answers
:mod:`engines.local.streaming`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from typing import TypedDict

import attrs

from engines.local.text import visible_text
from engines.local.validation import (
    MAX_LOGPROBS,
    GenerationOptions,
    ProtocolError,
    check_model,
    error_body,
    int_field,
    is_int,
    parse_bool,
    parse_json_object,
    parse_options,
    refuse_unsupported,
)
from engines.types import Completion, PromptLogprob, SamplingParams, nth_sample_params

__all__ = [
    "CompletionLogprobs",
    "CompletionRequest",
    "ProtocolError",
    "completion_logprobs",
    "completion_response",
    "error_body",
    "parse_bool",
    "parse_completion_request",
    "parse_json_object",
    "parse_prompt_logprobs",
    "prompt_logprobs_json",
    "usage",
]

#: vLLM's default ``max_tokens`` for /v1/completions.
DEFAULT_MAX_TOKENS = 16

#: Sampling fields vLLM knows that the reference engine does not implement, with the value
#: that means "off". Any other value is refused rather than silently ignored.
UNSUPPORTED_DEFAULTS: dict[str, tuple[object, ...]] = {
    "echo": (False, None),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "suffix": (None, ""),
    "logit_bias": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
}


def _token_ids(value: list[object], vocab_size: int, what: str) -> list[int]:
    ids: list[int] = []
    for tok in value:
        if not is_int(tok):
            raise ProtocolError(400, f"{what} must hold integer token ids, got {tok!r}", "prompt")
        if not 0 <= tok < vocab_size:
            raise ProtocolError(
                400, f"token id {tok} in {what} is out of vocabulary [0, {vocab_size})", "prompt"
            )
        ids.append(tok)
    return ids


def _prompts(value: object, encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """``prompt`` as vLLM accepts it: a string, token ids, or a list of either."""
    if isinstance(value, str):
        batch: list[object] = [value]
    elif isinstance(value, list) and value and all(is_int(t) for t in value):
        batch = [value]
    elif isinstance(value, list) and value:
        batch = value
    else:
        raise ProtocolError(
            400, "prompt must be a non-empty string, token-id list, or list of those", "prompt"
        )
    prompts: list[list[int]] = []
    for i, item in enumerate(batch):
        if isinstance(item, str):
            ids = encode(item)
        elif isinstance(item, list):
            ids = _token_ids(item, vocab_size, f"prompt[{i}]")
        else:
            raise ProtocolError(400, f"prompt[{i}] must be a string or a token-id list", "prompt")
        if not ids:
            raise ProtocolError(400, f"prompt[{i}] is empty", "prompt")
        prompts.append(ids)
    return prompts


class CompletionLogprobs(TypedDict):
    """The OpenAI completions ``logprobs`` of a choice (or of a streamed chunk's tokens)."""

    #: Where each token's string starts in the text (approximate for spacing).
    text_offset: list[int]
    token_logprobs: list[float]
    tokens: list[str]
    #: Per token: the sampled token's string and its alternatives', to their logprobs.
    top_logprobs: list[dict[str, float]]


@attrs.frozen
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    #: The served model name the response reports.
    model: str
    #: Token ids of each prompt (text prompts already tokenized).
    prompts: list[list[int]]
    #: Sampling, ``n``, streaming and token-id output.
    options: GenerationOptions
    #: ``None``: no logprobs; N: the sampled token's and the N most likely alternatives.
    logprobs: int | None
    #: vLLM's ``prompt_logprobs``: ``None``: none; k: each prompt token's and the k best.
    prompt_logprobs: int | None = None

    @property
    def n(self) -> int:
        return self.options.n

    @property
    def params(self) -> SamplingParams:
        return self.options.params

    @property
    def return_token_ids(self) -> bool:
        return self.options.return_token_ids

    def params_for(self, i: int) -> SamplingParams:
        """Sampling params of the ``i``-th completion of a prompt (distinct seeds)."""
        return nth_sample_params(self.params, i)


def parse_completion_request(
    body: dict[str, object],
    *,
    served_model: str,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    max_model_len: int,
) -> CompletionRequest:
    """Validate a completions body; raises :class:`ProtocolError` (400, or 404 for another model)."""
    check_model(body, served_model)
    refuse_unsupported(body, UNSUPPORTED_DEFAULTS)
    if "prompt" not in body:
        raise ProtocolError(400, "prompt is required", "prompt")
    prompts = _prompts(body["prompt"], encode, vocab_size)
    max_tokens = int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
    assert max_tokens is not None
    check_context(max(len(p) for p in prompts), max_tokens, max_model_len)
    logprobs = int_field(body, "logprobs", None, 0, MAX_LOGPROBS)
    options = parse_options(
        body, max_tokens=max_tokens, top_logprobs=logprobs or 0, prompts=len(prompts)
    )
    prompt_k = parse_prompt_logprobs(body, stream=options.stream)
    return CompletionRequest(
        model=served_model,
        prompts=prompts,
        options=attrs.evolve(
            options, params=attrs.evolve(options.params, prompt_logprobs=prompt_k)
        ),
        logprobs=logprobs,
        prompt_logprobs=prompt_k,
    )


def parse_prompt_logprobs(body: dict[str, object], *, stream: bool = False) -> int | None:
    """vLLM's ``prompt_logprobs``: None, or k in ``[0, MAX_LOGPROBS]`` (vLLM's ``-1``, the
    whole vocabulary, is past its default ``--max-logprobs`` too); k > 0 is refused with
    ``stream`` as vLLM refuses it (a streamed answer carries no prompt logprobs)."""
    k = int_field(body, "prompt_logprobs", None, 0, MAX_LOGPROBS)
    if stream and k:
        raise ProtocolError(
            400, "`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs"
        )
    return k


#: What vLLM writes for a logprob of -inf (``clamp_prompt_logprobs``): JSON has no infinity.
_NEG_INF_LOGPROB = -9999.0


def prompt_logprobs_json(
    scores: Sequence[PromptLogprob | None], decode_one: Callable[[int], str], prompt: Sequence[int]
) -> list[dict[str, dict[str, object]] | None]:
    """A choice's ``prompt_logprobs`` as vLLM writes them: per prompt token, None for the
    first, else a dict from token id (a string, as JSON keys are) to ``{"logprob", "rank",
    "decoded_token"}``: the prompt token first, then the k best (ranks 1..k; the prompt
    token once when it is among them)."""
    out: list[dict[str, dict[str, object]] | None] = []
    for tok, score in zip(prompt, scores, strict=True):
        if score is None:
            out.append(None)
            continue
        entries = [(tok, score.logprob, score.rank)]
        entries += [(t, lp, i + 1) for i, (t, lp) in enumerate(score.top)]
        position: dict[str, dict[str, object]] = {}
        for t, lp, rank in entries:
            position[str(t)] = {
                "logprob": max(lp, _NEG_INF_LOGPROB),
                "rank": rank,
                "decoded_token": decode_one(t),
            }
        out.append(position)
    return out


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """400 when prompt + ``max_tokens`` do not fit the model's context (vLLM's message)."""
    if prompt_len + max_tokens > max_model_len:
        raise ProtocolError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion). Please reduce the length of the prompt or "
            "max_tokens.",
            "max_tokens",
        )


def completion_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
    convert: Callable[[list[int]], list[str]],
    offset: int = 0,
) -> CompletionLogprobs:
    """OpenAI completions ``logprobs`` of some tokens: their strings, logprobs, text offsets
    (from ``offset``) and per token a dict of the sampled token and its alternatives."""
    tokens = convert(list(token_ids))
    offsets: list[int] = []
    pos = offset
    for tok in tokens:  # offsets of the token strings, concatenated (approximate for spacing)
        offsets.append(pos)
        pos += len(tok)
    tops: list[dict[str, float]] = []
    for i, (tok, lp) in enumerate(zip(tokens, logprobs)):
        entry = {tok: lp}
        if i < len(top) and top[i]:
            alternatives = convert([t for t, _ in top[i]])
            entry |= {s: v for s, (_, v) in zip(alternatives, top[i]) if s not in entry}
        tops.append(entry)
    return {
        "text_offset": offsets,
        "token_logprobs": list(logprobs),
        "tokens": tokens,
        "top_logprobs": tops,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    """vLLM's ``UsageInfo``."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_response(
    req: CompletionRequest,
    results: Sequence[Sequence[Completion]],
    *,
    decode: Callable[[list[int]], str],
    convert_ids_to_tokens: Callable[[list[int]], list[str]],
    decode_one: Callable[[int], str],
) -> dict[str, object]:
    """The ``/v1/completions`` response: choice ``i * n + j`` is sample ``j`` of prompt ``i``.
    ``decode_one``: one token id's text (a prompt logprob's ``decoded_token``)."""
    choices = []
    completion_tokens = 0
    opts = req.options
    for i, per_prompt in enumerate(results):
        for j, c in enumerate(per_prompt):
            completion_tokens += len(c.token_ids)
            choice: dict[str, object] = {
                "index": i * req.n + j,
                "text": visible_text(decode(c.token_ids), req.params.stop, opts.include_stop_str),
                "logprobs": None
                if req.logprobs is None
                else completion_logprobs(
                    c.token_ids, c.logprobs, c.top_logprobs, convert_ids_to_tokens
                ),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "prompt_logprobs": None
                if req.prompt_logprobs is None
                else prompt_logprobs_json(c.prompt_logprobs, decode_one, req.prompts[i]),
                "token_ids": list(c.token_ids) if opts.return_token_ids else None,
                "prompt_token_ids": list(req.prompts[i]) if opts.return_token_ids else None,
            }
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in req.prompts) * req.n
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }
