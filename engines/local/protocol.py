"""Parsing, validation and response shapes of the vLLM/OpenAI protocol subset we serve.

Everything here is pure (no I/O): the server hands it bytes and query strings and gets back
values or a :class:`ProtocolError`, which the server turns into a 4xx with vLLM's error body::

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

(vLLM's ``ErrorResponse``/``ErrorInfo``: ``code`` is the HTTP status as an int.)
Bad input of any shape raises ``ProtocolError``, never another exception: the server treats
anything else as its own bug (a 5xx), and the tests hold that no input reaches that path.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from engines.types import Completion, SamplingParams, nth_sample_params

__all__ = [
    "CompletionRequest",
    "ProtocolError",
    "completion_response",
    "error_body",
    "parse_bool",
    "parse_completion_request",
    "parse_json_object",
]

#: Most completions one request may ask for (prompts x n); keeps one request from hogging the engine.
MAX_CHOICES = 256
#: vLLM's default ``max_tokens`` for /v1/completions.
DEFAULT_MAX_TOKENS = 16
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "UnauthorizedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    500: "InternalServerError",
    501: "NotImplementedError",
}

#: Sampling fields vLLM knows that the reference engine does not implement, with the value
#: that means "off". Any other value is refused rather than silently ignored.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "echo": (False, None),
    "stop": (None, "", []),
    "best_of": (None, 1),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "top_k": (None, 0, -1),
    "min_p": (None, 0, 0.0),
    "min_tokens": (None, 0),
    "prompt_logprobs": (None,),
    "suffix": (None, ""),
}


class ProtocolError(Exception):
    """A request the server refuses: HTTP ``status`` with a vLLM-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status = status
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """vLLM's ``ErrorResponse`` JSON for an HTTP status."""
    err_type = _ERROR_TYPES.get(
        status, "BadRequestError" if status < 500 else "InternalServerError"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict[str, Any]:
    """Decode a request body that must be a JSON object (NaN/Infinity refused)."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(
            400, f"the request body must be a JSON object, not {type(value).__name__}"
        )
    return value


def parse_bool(raw: str | None, name: str, default: bool) -> bool:
    """A boolean query parameter, spelled as FastAPI accepts it (true/false/1/0/yes/no/on/off)."""
    if raw is None:
        return default
    low = raw.strip().lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise ProtocolError(400, f"query parameter {name}={raw!r} is not a boolean", name)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_field(
    body: dict[str, Any], name: str, default: int | None, lo: int | None, hi: int | None = None
) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if not _is_int(value):
        raise ProtocolError(400, f"{name} must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise ProtocolError(400, f"{name} must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ProtocolError(400, f"{name} must be at most {hi}, got {value}", name)
    return value


def _float_field(body: dict[str, Any], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value):
        raise ProtocolError(400, f"{name} must be a number, got {value!r}", name)
    return float(value)


def _bool_field(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(400, f"{name} must be a boolean, got {value!r}", name)
    return value


def _token_ids(value: list[Any], vocab_size: int, what: str) -> list[int]:
    for tok in value:
        if not _is_int(tok):
            raise ProtocolError(400, f"{what} must hold integer token ids, got {tok!r}", "prompt")
        if not 0 <= tok < vocab_size:
            raise ProtocolError(
                400, f"token id {tok} in {what} is out of vocabulary [0, {vocab_size})", "prompt"
            )
    return list(value)


def _prompts(value: Any, encode: Callable[[str], list[int]], vocab_size: int) -> list[list[int]]:
    """``prompt`` as vLLM accepts it: a string, token ids, or a list of either."""
    if isinstance(value, str):
        batch: list[Any] = [value]
    elif isinstance(value, list) and value and all(_is_int(t) for t in value):
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


@attrs.frozen
class CompletionRequest:
    """A validated ``POST /v1/completions`` body."""

    #: The served model name the response reports.
    model: str
    #: Token ids of each prompt (text prompts already tokenized).
    prompts: list[list[int]]
    #: Completions per prompt.
    n: int
    #: Sampling for every completion; with a seed, completion ``i`` of a prompt uses ``seed + i``.
    params: SamplingParams
    #: ``None``: no logprobs; 0: the sampled token's (larger values are refused).
    logprobs: int | None
    #: Whether choices carry ``token_ids`` and ``prompt_token_ids``.
    return_token_ids: bool

    def params_for(self, i: int) -> SamplingParams:
        """Sampling params of the ``i``-th completion of a prompt (distinct seeds)."""
        return nth_sample_params(self.params, i)


def parse_completion_request(
    body: dict[str, Any],
    *,
    served_model: str,
    encode: Callable[[str], list[int]],
    vocab_size: int,
    max_model_len: int,
) -> CompletionRequest:
    """Validate a completions body; raises :class:`ProtocolError` (400, or 404 for another model)."""
    model = body.get("model")
    if model is not None and model != served_model:
        if not isinstance(model, str):
            raise ProtocolError(400, f"model must be a string, got {model!r}", "model")
        raise ProtocolError(404, f"The model `{model}` does not exist.", "model")
    for name, allowed in _UNSUPPORTED_DEFAULTS.items():
        if name in body and not any(
            (body[name] == ok and type(body[name]) is type(ok)) or body[name] is ok
            for ok in allowed
        ):
            raise ProtocolError(
                400, f"{name}={body[name]!r} is not supported by the reference engine", name
            )
    if "prompt" not in body:
        raise ProtocolError(400, "prompt is required", "prompt")
    prompts = _prompts(body["prompt"], encode, vocab_size)
    max_tokens = _int_field(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
    assert max_tokens is not None
    longest = max(len(p) for p in prompts)
    if longest + max_tokens > max_model_len:
        raise ProtocolError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} "
            "in the completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    n = _int_field(body, "n", 1, 1, MAX_CHOICES)
    assert n is not None
    if n * len(prompts) > MAX_CHOICES:
        raise ProtocolError(400, f"prompts x n must be at most {MAX_CHOICES}", "n")
    temperature = _float_field(body, "temperature", 1.0)
    if temperature < 0:
        raise ProtocolError(
            400, f"temperature must be non-negative, got {temperature}", "temperature"
        )
    top_p = _float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ProtocolError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    seed = _int_field(body, "seed", None, _SEED_MIN, _SEED_MAX)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise ProtocolError(
            400, "stop_token_ids must be a list of non-negative integers", "stop_token_ids"
        )
    logprobs = _int_field(body, "logprobs", None, 0)
    if logprobs is not None and logprobs > 0:
        raise ProtocolError(
            400,
            "the reference engine returns only the sampled token's logprob: use logprobs=0",
            "logprobs",
        )
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed % 2**64 if seed is not None else None,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=_bool_field(body, "ignore_eos", False),
    )
    return CompletionRequest(
        model=served_model,
        prompts=prompts,
        n=n,
        params=params,
        logprobs=logprobs,
        return_token_ids=_bool_field(body, "return_token_ids", False),
    )


def _logprobs_block(
    completion: Completion, convert: Callable[[list[int]], list[str]]
) -> dict[str, Any]:
    """OpenAI completions ``logprobs``: tokens, their logprobs, offsets and top-1 dicts."""
    tokens = convert(completion.token_ids)
    offsets: list[int] = []
    pos = 0
    for tok in tokens:  # offsets of the token strings, concatenated (approximate for spacing)
        offsets.append(pos)
        pos += len(tok)
    return {
        "text_offset": offsets,
        "token_logprobs": list(completion.logprobs),
        "tokens": tokens,
        "top_logprobs": [{tok: lp} for tok, lp in zip(tokens, completion.logprobs)],
    }


def completion_response(
    req: CompletionRequest,
    results: Sequence[Sequence[Completion]],
    *,
    decode: Callable[[list[int]], str],
    convert_ids_to_tokens: Callable[[list[int]], list[str]],
) -> dict[str, Any]:
    """The ``/v1/completions`` response: choice ``i * n + j`` is sample ``j`` of prompt ``i``."""
    choices = []
    completion_tokens = 0
    for i, per_prompt in enumerate(results):
        for j, c in enumerate(per_prompt):
            completion_tokens += len(c.token_ids)
            choice: dict[str, Any] = {
                "index": i * req.n + j,
                "text": decode(c.token_ids),
                "logprobs": None
                if req.logprobs is None
                else _logprobs_block(c, convert_ids_to_tokens),
                "finish_reason": c.finish_reason,
                "stop_reason": c.token_ids[-1]
                if c.finish_reason == "stop"
                and c.token_ids
                and c.token_ids[-1] in req.params.stop_token_ids
                else None,
                "prompt_logprobs": None,
                "token_ids": list(c.token_ids) if req.return_token_ids else None,
                "prompt_token_ids": list(req.prompts[i]) if req.return_token_ids else None,
            }
            choices.append(choice)
    prompt_tokens = sum(len(p) for p in req.prompts) * req.n
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }
