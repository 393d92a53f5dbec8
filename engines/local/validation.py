"""Request validation both OpenAI routes share: the error type, field readers, sampling options.

Everything here is pure (no I/O). Bad input of any shape raises :class:`ProtocolError`,
which the server turns into a 4xx with vLLM's error body::

    {"error": {"message": "...", "type": "BadRequestError", "param": "max_tokens", "code": 400}}

(vLLM's ``ErrorResponse``/``ErrorInfo``: ``code`` is the HTTP status as an int.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import NoReturn, TypedDict, TypeGuard

import attrs

from engines.local.requests import EngineAsleepError, EngineDeadError
from engines.lora_answers import unknown_model
from engines.types import SamplingParams

__all__ = [
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "ErrorBody",
    "ErrorInfo",
    "GenerationOptions",
    "ProtocolError",
    "bool_field",
    "check_model",
    "error_body",
    "int_field",
    "is_int",
    "parse_bool",
    "parse_json_object",
    "parse_options",
    "refuse_unsupported",
]

#: Most completions one request may ask for (prompts x n); keeps one request from hogging the engine.
MAX_CHOICES = 256
#: Most alternatives per token (vLLM's default ``--max-logprobs``).
MAX_LOGPROBS = 20
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


class ErrorInfo(TypedDict):
    """vLLM's ``ErrorInfo``."""

    message: str
    type: str
    param: str | None
    #: The HTTP status.
    code: int


class ErrorBody(TypedDict):
    """vLLM's ``ErrorResponse``: the body of every 4xx and 5xx."""

    error: ErrorInfo


class ProtocolError(Exception):
    """A request the server refuses: HTTP ``status`` with a vLLM-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(status, message, param)
        self.status = status
        self.message = message
        self.param = param

    def __str__(self) -> str:
        return f"{self.status}: {self.message}"

    def body(self) -> ErrorBody:
        return error_body(self.status, self.message, self.param)


def error_body(status: int, message: str, param: str | None = None) -> ErrorBody:
    """vLLM's ``ErrorResponse`` JSON for an HTTP status."""
    err_type = _ERROR_TYPES.get(
        status, "BadRequestError" if status < 500 else "InternalServerError"
    )
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


def refusal(exc: EngineAsleepError | EngineDeadError) -> ProtocolError:
    """The answer to a generation the engine refused: 409 while asleep, 500 once dead (vLLM's
    answer once its engine died; its server then shuts down, as the reference's does)."""
    return ProtocolError(500 if isinstance(exc, EngineDeadError) else 409, str(exc))


def _reject_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_object(body: bytes) -> dict[str, object]:
    """Decode a request body that must be a JSON object (NaN/Infinity refused, and strings
    holding a lone surrogate such as ``"\\ud800"``: JSON lets one be written, but it is no
    Unicode text a tokenizer or a file name can take)."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProtocolError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ProtocolError(
            400, f"the request body must be a JSON object, not {type(value).__name__}"
        )
    if _holds_lone_surrogate(value):
        raise ProtocolError(
            400,
            "the request body holds a lone UTF-16 surrogate (an escape such as \\ud800 "
            "without its pair): not Unicode text",
        )
    return value


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _holds_lone_surrogate(value: object) -> bool:
    """Whether a string anywhere in the decoded JSON ``value`` (keys too) holds a surrogate
    code point (json pairs the valid ones into one character)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


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


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def int_field(
    body: Mapping[str, object],
    name: str,
    default: int | None,
    lo: int | None,
    hi: int | None = None,
) -> int | None:
    """``body[name]`` as an int in ``[lo, hi]``; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not is_int(value):
        raise ProtocolError(400, f"{name} must be an integer, got {value!r}", name)
    if lo is not None and value < lo:
        raise ProtocolError(400, f"{name} must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise ProtocolError(400, f"{name} must be at most {hi}, got {value}", name)
    return value


def _float_field(body: Mapping[str, object], name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ProtocolError(400, f"{name} must be a number, got {value!r}", name)
    return float(value)


def bool_field(body: Mapping[str, object], name: str, default: bool) -> bool:
    """``body[name]`` as a bool; ``default`` when absent or null."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ProtocolError(400, f"{name} must be a boolean, got {value!r}", name)
    return value


def check_model(body: Mapping[str, object], served_model: str) -> None:
    """``model`` absent or the served one; 404 for another, as vLLM answers."""
    model = body.get("model")
    if model is not None and model != served_model:
        if not isinstance(model, str):
            raise ProtocolError(400, f"model must be a string, got {model!r}", "model")
        raise ProtocolError(404, unknown_model(model).message, "model")


def refuse_unsupported(
    body: Mapping[str, object], defaults: Mapping[str, tuple[object, ...]]
) -> None:
    """400 for a field the reference engine does not implement set to anything but "off"."""
    for name, allowed in defaults.items():
        if name in body and not any(
            (body[name] == ok and type(body[name]) is type(ok)) or body[name] is ok
            for ok in allowed
        ):
            raise ProtocolError(
                400, f"{name}={body[name]!r} is not supported by the reference engine", name
            )


def _stop_strings(value: object) -> tuple[str, ...]:
    """``stop`` as vLLM accepts it: null, a string, or a list of strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list) and all(isinstance(s, str) for s in value):
        return tuple(s for s in value if s)
    raise ProtocolError(400, "stop must be a string or a list of strings", "stop")


@attrs.frozen
class GenerationOptions:
    """What both routes read the same way: sampling, ``n``, streaming and token-id output."""

    #: Sampling of every completion (``max_tokens`` and ``top_logprobs`` set by the route).
    params: SamplingParams
    #: Completions per prompt.
    n: int
    #: Answer as server-sent events.
    stream: bool
    #: ``stream_options.include_usage``: a last chunk with the usage and no choices.
    include_usage: bool
    #: Keep the stop string at the end of the text.
    include_stop_str: bool
    #: Whether choices carry ``token_ids`` (and the response ``prompt_token_ids``).
    return_token_ids: bool
    #: Leave special tokens (``<pad>``, ``<eos>``, ...) out of the text (vLLM's default); the
    #: token ids keep them either way.
    skip_special_tokens: bool = True


def parse_options(
    body: Mapping[str, object], *, max_tokens: int, top_logprobs: int, prompts: int = 1
) -> GenerationOptions:
    """Validate the shared fields of a completions or chat body (see :class:`GenerationOptions`)."""
    n = int_field(body, "n", 1, 1, MAX_CHOICES)
    assert n is not None
    if n * prompts > MAX_CHOICES:
        raise ProtocolError(400, f"prompts x n must be at most {MAX_CHOICES}", "n")
    temperature = _float_field(body, "temperature", 1.0)
    if temperature < 0:
        raise ProtocolError(
            400, f"temperature must be non-negative, got {temperature}", "temperature"
        )
    top_p = _float_field(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise ProtocolError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    seed = int_field(body, "seed", None, _SEED_MIN, _SEED_MAX)
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    if not isinstance(stop_ids, list) or not all(is_int(t) and t >= 0 for t in stop_ids):
        raise ProtocolError(
            400, "stop_token_ids must be a list of non-negative integers", "stop_token_ids"
        )
    stream = bool_field(body, "stream", False)
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise ProtocolError(
                400, "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(stream_options, dict):
            raise ProtocolError(400, "stream_options must be an object", "stream_options")
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        seed=seed % 2**64 if seed is not None else None,
        stop_token_ids=tuple(stop_ids),
        ignore_eos=bool_field(body, "ignore_eos", False),
        stop=_stop_strings(body.get("stop")),
        top_logprobs=top_logprobs,
    )
    return GenerationOptions(
        params=params,
        n=n,
        stream=stream,
        include_usage=bool_field(stream_options or {}, "include_usage", False),
        include_stop_str=bool_field(body, "include_stop_str_in_output", False),
        return_token_ids=bool_field(body, "return_token_ids", False),
        skip_special_tokens=bool_field(body, "skip_special_tokens", True),
    )
