"""The ``/v1/chat/completions`` route's request and response shapes (vLLM's OpenAI server).

Pure (no I/O), like :mod:`engines.local.protocol`: a body becomes a :class:`ChatRequest` or
a :class:`ProtocolError`. Messages are rendered with the model's chat template (the
server's ``render`` callback: ``tokenizer.apply_chat_template``, then the text tokenized
without special tokens, as vLLM does); a model without a template answers 400. Message
content is a string or a list of ``{"type": "text", "text": ...}`` parts (joined with
newlines, vLLM's "string" content format); other part types are refused.

``tools`` are accepted only with ``tool_choice="none"``: the reference engine has no tool
parser, as ``vllm serve`` without ``--enable-auto-tool-choice`` (tool calls are then text the
agent parses itself). The assistant message never carries ``tool_calls``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import attrs

from engines.local.protocol import UNSUPPORTED_DEFAULTS, check_context, usage
from engines.local.text import visible_text
from engines.local.validation import (
    MAX_LOGPROBS,
    GenerationOptions,
    ProtocolError,
    bool_field,
    check_model,
    int_field,
    parse_options,
    refuse_unsupported,
)
from engines.types import Completion, SamplingParams, nth_sample_params

__all__ = [
    "ChatRequest",
    "Renderer",
    "chat_logprobs",
    "chat_response",
    "parse_chat_request",
]

#: ``(messages, add_generation_prompt, chat_template_kwargs) -> prompt token ids``; raises
#: ``ProtocolError`` when the model has no template or the template fails.
Renderer = Callable[[list[dict[str, object]], bool, dict[str, object]], list[int]]

#: Chat fields the reference engine does not implement, with the values that mean "off".
CHAT_UNSUPPORTED_DEFAULTS: dict[str, tuple[object, ...]] = {
    **{k: v for k, v in UNSUPPORTED_DEFAULTS.items() if k not in ("best_of", "suffix")},
    "prompt_logprobs": (None,),
    "continue_final_message": (False, None),
    "chat_template": (None,),
    "add_special_tokens": (False, None),
    "use_beam_search": (False, None),
    "logprob_token_ids": (None,),
    "documents": (None,),
}

_MESSAGE_KEYS = ("role", "content", "name", "tool_calls", "tool_call_id")


@attrs.frozen
class ChatRequest:
    """A validated ``POST /v1/chat/completions`` body."""

    #: The served model name the response reports.
    model: str
    #: The rendered prompt's token ids.
    prompt_ids: list[int]
    #: Sampling, ``n``, streaming and token-id output.
    options: GenerationOptions
    #: ``logprobs: true``: each choice carries the sampled tokens' logprobs.
    logprobs: bool
    #: Alternatives per token (``top_logprobs``; only with ``logprobs``).
    top_logprobs: int

    @property
    def n(self) -> int:
        return self.options.n

    @property
    def params(self) -> SamplingParams:
        return self.options.params

    def params_for(self, i: int) -> SamplingParams:
        """Sampling params of the ``i``-th choice (distinct seeds)."""
        return nth_sample_params(self.params, i)


def _content(value: object, i: int) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for part in value:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                raise ProtocolError(
                    400,
                    f"messages[{i}].content: only text parts are supported by the reference engine",
                    "messages",
                )
            text = part.get("text")
            if not isinstance(text, str):
                raise ProtocolError(
                    400, f"messages[{i}].content: text must be a string", "messages"
                )
            texts.append(text)
        return "\n".join(texts)
    raise ProtocolError(
        400, f"messages[{i}].content must be a string, a list of parts or null", "messages"
    )


def _messages(value: object) -> list[dict[str, object]]:
    """The conversation as the chat template sees it (content flattened to a string)."""
    if not isinstance(value, list) or not value:
        raise ProtocolError(400, "messages must be a non-empty list", "messages")
    out: list[dict[str, object]] = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
            raise ProtocolError(400, f"messages[{i}] must be an object with a role", "messages")
        kept = {k: msg[k] for k in _MESSAGE_KEYS if msg.get(k) is not None}
        kept["content"] = _content(msg.get("content"), i) or ""
        out.append(kept)
    return out


def parse_chat_request(
    body: dict[str, object],
    *,
    served_model: str,
    render: Renderer,
    max_model_len: int,
) -> ChatRequest:
    """Validate a chat body and render its prompt; raises :class:`ProtocolError`."""
    check_model(body, served_model)
    refuse_unsupported(body, CHAT_UNSUPPORTED_DEFAULTS)
    if body.get("tools") and body.get("tool_choice", "auto") != "none":
        raise ProtocolError(
            400,
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to '
            'be set: the reference engine has no tool parser; send tool_choice="none" and '
            "parse tool calls from the text",
            "tool_choice",
        )
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ProtocolError(400, "chat_template_kwargs must be an object", "chat_template_kwargs")
    prompt_ids = render(
        _messages(body.get("messages")), bool_field(body, "add_generation_prompt", True), kwargs
    )
    if not prompt_ids:
        raise ProtocolError(400, "the rendered prompt is empty", "messages")
    room = max_model_len - len(prompt_ids)
    requested = int_field(body, "max_completion_tokens", None, 1)
    if requested is None:
        requested = int_field(body, "max_tokens", None, 1)
    max_tokens = requested if requested is not None else room
    check_context(len(prompt_ids), max(max_tokens, 1), max_model_len)
    logprobs = bool_field(body, "logprobs", False)
    top = int_field(body, "top_logprobs", 0, 0, MAX_LOGPROBS) or 0
    if top and not logprobs:
        raise ProtocolError(
            400, "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
        )
    return ChatRequest(
        model=served_model,
        prompt_ids=prompt_ids,
        options=parse_options(body, max_tokens=max_tokens, top_logprobs=top),
        logprobs=logprobs,
        top_logprobs=top,
    )


def _logprob_entry(token: str, logprob: float) -> dict[str, object]:
    return {
        "token": token,
        "logprob": max(logprob, -9999.0),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def chat_logprobs(
    token_ids: Sequence[int],
    logprobs: Sequence[float],
    top: Sequence[Sequence[tuple[int, float]]],
    token_text: Callable[[int], str],
) -> dict[str, object]:
    """Chat ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    content = []
    for i, (tok, lp) in enumerate(zip(token_ids, logprobs)):
        alternatives = top[i] if i < len(top) else ()
        content.append(
            _logprob_entry(token_text(tok), lp)
            | {"top_logprobs": [_logprob_entry(token_text(t), v) for t, v in alternatives]}
        )
    return {"content": content}


def chat_response(
    req: ChatRequest,
    results: Sequence[Completion],
    *,
    decode: Callable[[list[int]], str],
    token_text: Callable[[int], str],
) -> dict[str, object]:
    """The ``/v1/chat/completions`` response: choice ``j`` is sample ``j``."""
    opts = req.options
    choices = []
    for j, c in enumerate(results):
        text = visible_text(decode(c.token_ids), req.params.stop, opts.include_stop_str)
        choices.append(
            {
                "index": j,
                "message": {"role": "assistant", "content": text, "reasoning": None},
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, c.top_logprobs, token_text)
                if req.logprobs
                else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if opts.return_token_ids else None,
            }
        )
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(len(req.prompt_ids), sum(len(c.token_ids) for c in results)),
        "prompt_logprobs": None,
        "prompt_token_ids": list(req.prompt_ids) if opts.return_token_ids else None,
    }
