"""The reference server's request and response values (plain data, no framework)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import attrs

from engines.client import STEP_HEADER
from engines.local.validation import error_body

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable

__all__ = [
    "MAX_BODY_BYTES",
    "BodyTooLarge",
    "Request",
    "Response",
    "StreamBody",
    "answer_lifespan",
    "error_response",
    "json_response",
    "read_body",
]


async def answer_lifespan(receive: ASGIReceiveCallable, send: ASGISendCallable) -> None:
    """An ASGI app's ``lifespan`` scope for an app with nothing to start or stop: completes
    the startup and the shutdown messages, and returns after the shutdown."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


#: Largest request body accepted (413 beyond).
MAX_BODY_BYTES = 8 * 1024 * 1024


class BodyTooLarge(Exception):
    """A request body past the limit :func:`read_body` was given (answer 413)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"request body over {limit} bytes")
        self.limit = limit


async def read_body(receive: ASGIReceiveCallable, limit: int = MAX_BODY_BYTES) -> bytes | None:
    """An ASGI ``http`` request's whole body, read from its ``http.request`` messages; None
    when the client disconnected first; :class:`BodyTooLarge` once it passes ``limit`` bytes
    (what is left of it is not read)."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > limit:
            raise BodyTooLarge(limit)
        if not message.get("more_body", False):
            return bytes(body)


@attrs.frozen
class Request:
    """One HTTP request, fully read."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes

    def arg(self, name: str) -> str | None:
        """The last value of query parameter ``name``, or None."""
        values = self.query.get(name)
        return values[-1] if values else None

    @property
    def step(self) -> int | None:
        """The trainer step from ``X-Trainer-Step``; None when absent or not an integer."""
        raw = self.headers.get(STEP_HEADER.lower())  # headers arrive lower-cased
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None


#: Writes a streamed body: awaited with a ``write(chunk)`` that sends one chunk.
StreamBody = Callable[[Callable[[bytes], Awaitable[None]]], Awaitable[None]]


@attrs.frozen
class Response:
    """One HTTP response: ``body``, or with ``stream`` a body written as it is produced."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    #: Streamed responses (server-sent events): the server awaits it after the headers.
    stream: StreamBody | None = None


def json_response(payload: object, status: int = 200) -> Response:
    """A JSON response."""
    return Response(status, json.dumps(payload).encode())


def error_response(status: int, message: str, param: str | None = None) -> Response:
    """A vLLM ``ErrorResponse`` with HTTP ``status``."""
    return json_response(error_body(status, message, param), status)
