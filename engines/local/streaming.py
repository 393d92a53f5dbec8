"""Streamed answers (``stream=true``): server-sent events as vLLM's OpenAI server sends them.

Each event is ``data: {json}\\n\\n``; the stream ends with ``data: [DONE]\\n\\n``. A choice's
chunks carry its new text (see :class:`~engines.local.text.TextStream`: held back near a
possible stop string), its new token ids (with ``return_token_ids``) and logprobs (when
asked), one sampled token per chunk; its last chunk carries the ``finish_reason`` (and
``stop_reason``). Chat streams open each choice with a ``{"role": "assistant", "content":
""}`` delta; ``stream_options.include_usage`` adds a last chunk with the usage and no
choices. An engine error mid-stream (the engine was put to sleep) becomes a ``data:`` event
with vLLM's error body, then ``[DONE]``.

:func:`stream_events` runs one generation task per choice in a nursery it owns and writes
events as tokens arrive; when its caller is cancelled (the client went away) the
generations are cancelled with it, and they leave the engine's batch.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import attrs
import trio

from engines.local.chat_protocol import chat_logprobs
from engines.local.protocol import completion_logprobs, usage
from engines.local.requests import EngineAsleepError, EngineDeadError, TokenCallback
from engines.local.text import TextStream
from engines.local.validation import ProtocolError, refusal
from engines.types import Completion, SamplingParams
from trainer.vocabulary import open_owner_nursery

__all__ = [
    "ChatChunks",
    "ChunkFormat",
    "CompletionChunks",
    "Generate",
    "Piece",
    "sse",
    "stream_events",
]

#: The engine's ``generate``: ``(prompt_ids, params, on_token=...) -> Completion``.
Generate = Callable[..., Awaitable[Completion]]


def sse(payload: object) -> bytes:
    """One server-sent event: ``data: <json>\\n\\n``."""
    return f"data: {json.dumps(payload)}\n\n".encode()


@attrs.frozen
class Piece:
    """What one chunk reports of one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChunkFormat(Protocol):
    """The route's chunk shapes."""

    def opening(self, index: int) -> dict[str, object] | None:
        """The chunk a choice starts with, if the route sends one."""
        ...

    def piece(self, piece: Piece) -> dict[str, object]:
        """A chunk of new tokens (the last one with its finish reason)."""
        ...

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
        """The usage chunk (no choices)."""
        ...


@attrs.define
class _Envelope:
    object: str
    model: str
    id: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    def wrap(self, choices: list[dict[str, object]], **extra: object) -> dict[str, object]:
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


@attrs.define
class CompletionChunks:
    """``/v1/completions`` chunks (``CompletionStreamResponse``)."""

    model: str
    #: The prompt ids of each choice (sent on its first chunk with ``return_token_ids``).
    prompt_ids: Sequence[list[int]]
    logprobs: int | None
    return_token_ids: bool
    convert_ids_to_tokens: Callable[[list[int]], list[str]]
    _envelope: _Envelope = attrs.field(init=False)
    _offsets: dict[int, int] = attrs.field(init=False, factory=dict)
    _sent_prompt: set[int] = attrs.field(init=False, factory=set)

    def __attrs_post_init__(self) -> None:
        self._envelope = _Envelope("text_completion", self.model, f"cmpl-{uuid.uuid4().hex}")

    def opening(self, index: int) -> dict[str, object] | None:
        return None

    def piece(self, piece: Piece) -> dict[str, object]:
        logprobs = None
        if self.logprobs is not None:
            logprobs = completion_logprobs(
                piece.token_ids,
                piece.logprobs,
                piece.top,
                self.convert_ids_to_tokens,
                self._offsets.get(piece.index, 0),
            )
            if logprobs["tokens"]:
                self._offsets[piece.index] = logprobs["text_offset"][-1] + len(
                    logprobs["tokens"][-1]
                )
        choice: dict[str, object] = {
            "index": piece.index,
            "text": piece.text,
            "logprobs": logprobs,
            "finish_reason": piece.finish_reason,
            "stop_reason": piece.stop_reason,
        }
        if self.return_token_ids:
            if piece.index not in self._sent_prompt:  # the prompt rides on a choice's first chunk
                choice["prompt_token_ids"] = list(self.prompt_ids[piece.index])
                self._sent_prompt.add(piece.index)
            choice["token_ids"] = list(piece.token_ids)
        return self._envelope.wrap([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
        return self._envelope.wrap([], usage=usage(prompt_tokens, completion_tokens))


@attrs.define
class ChatChunks:
    """``/v1/chat/completions`` chunks (``ChatCompletionStreamResponse``)."""

    model: str
    prompt_ids: list[int]
    logprobs: bool
    return_token_ids: bool
    token_text: Callable[[int], str]
    _envelope: _Envelope = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._envelope = _Envelope(
            "chat.completion.chunk", self.model, f"chatcmpl-{uuid.uuid4().hex}"
        )

    def opening(self, index: int) -> dict[str, object] | None:
        choice = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return self._envelope.wrap(
            [choice], prompt_token_ids=list(self.prompt_ids) if self.return_token_ids else None
        )

    def piece(self, piece: Piece) -> dict[str, object]:
        choice: dict[str, object] = {
            "index": piece.index,
            "delta": {"content": piece.text},
            "logprobs": chat_logprobs(piece.token_ids, piece.logprobs, piece.top, self.token_text)
            if self.logprobs
            else None,
            "finish_reason": piece.finish_reason,
            "token_ids": list(piece.token_ids) if self.return_token_ids else None,
        }
        if piece.finish_reason is not None:
            choice["stop_reason"] = piece.stop_reason
        return self._envelope.wrap([choice])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, object]:
        return self._envelope.wrap([], usage=usage(prompt_tokens, completion_tokens))


@attrs.frozen
class _Token:
    index: int
    token: int
    logprob: float
    top: list[tuple[int, float]]


async def stream_events(
    write: Callable[[bytes], Awaitable[None]],
    generate: Generate,
    jobs: Sequence[tuple[list[int], SamplingParams]],
    fmt: ChunkFormat,
    *,
    decode: Callable[[list[int]], str],
    include_stop_str: bool,
    include_usage: bool,
) -> None:
    """Generate ``jobs`` (one ``(prompt ids, params)`` per choice, choice ``i`` = job ``i``)
    and write their chunks as the tokens come (see the module docstring)."""
    send, receive = trio.open_memory_channel[_Token | tuple[int, Completion | ProtocolError]](
        math.inf
    )
    texts = [TextStream(decode, p.stop, include_stop_str) for _, p in jobs]

    async def run(index: int, prompt_ids: list[int], params: SamplingParams) -> None:
        def on_token(token: int, logprob: float, top: list[tuple[int, float]]) -> None:
            send.send_nowait(_Token(index, token, logprob, top))

        callback: TokenCallback = on_token
        try:
            result: Completion | ProtocolError = await generate(
                prompt_ids, params, on_token=callback
            )
        except (EngineAsleepError, EngineDeadError) as exc:
            result = refusal(exc)
        send.send_nowait((index, result))

    prompt_tokens = sum(len(p) for p, _ in jobs)
    completion_tokens = 0
    async with open_owner_nursery() as nursery:
        for i, (prompt_ids, params) in enumerate(jobs):
            nursery.start_soon(run, i, prompt_ids, params)
        for i in range(len(jobs)):
            opening = fmt.opening(i)
            if opening is not None:
                await write(sse(opening))
        held: dict[int, _Token] = {}  # each choice's newest token, sent with the next event
        running = len(jobs)
        while running:
            event = await receive.receive()
            if isinstance(event, _Token):
                previous = held.pop(event.index, None)
                held[event.index] = event
                if previous is not None:
                    await write(sse(fmt.piece(_piece(previous, texts, None))))
                continue
            index, result = event
            running -= 1
            if isinstance(result, ProtocolError):
                await write(sse(result.body()))
                nursery.cancel_scope.cancel()
                break
            completion_tokens += len(result.token_ids)
            last = held.pop(index, None)
            await write(sse(fmt.piece(_piece(last, texts, result, index))))
    if include_usage:
        await write(sse(fmt.usage(prompt_tokens, completion_tokens)))
    await write(b"data: [DONE]\n\n")


def _piece(
    token: _Token | None,
    texts: list[TextStream],
    result: Completion | None,
    index: int | None = None,
) -> Piece:
    """The chunk of ``token`` (None: no new token), final when ``result`` is given."""
    i = token.index if token is not None else index
    assert i is not None
    ids = [token.token] if token is not None else []
    return Piece(
        index=i,
        text=texts[i].push(ids, finished=result is not None),
        token_ids=ids,
        logprobs=[token.logprob] if token is not None else [],
        top=[token.top] if token is not None and token.top else [],
        finish_reason=result.finish_reason if result is not None else None,
        stop_reason=result.stop_reason if result is not None else None,
    )
