"""Tiny real HTTP servers for client tests: a hand-written ASGI app on hypercorn's trio worker."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

#: (method, path, headers) -> (status, body); may await forever to model a hung server.
Handler = Callable[[str, str, dict[str, str]], Awaitable[tuple[int, Any]]]


def asgi(handler: Handler) -> Callable[..., Awaitable[None]]:
    """An ASGI app answering every HTTP request with ``await handler(method, path, headers)``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                kind = message["type"].split(".")[-1]
                await send({"type": f"lifespan.{kind}.complete"})
                if kind == "shutdown":
                    return
        while (await receive()).get("more_body"):
            pass
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        status, body = await handler(scope["method"], scope["path"], headers)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": raw})

    return app


@asynccontextmanager
async def serve_app(handler: Handler) -> AsyncIterator[str]:
    """Serve ``handler`` on 127.0.0.1 (a free port) for the block; yields its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 0.1
    config.accesslog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            partial(serve, asgi(handler), config, shutdown_trigger=shutdown.wait)
        )
        try:
            yield binds[0]
        finally:
            shutdown.set()


async def stats(url: str) -> dict[str, Any]:
    """The reference server's ``GET /engine_stats``."""
    async with httpx.AsyncClient() as http:
        return (await http.get(f"{url}/engine_stats")).json()


def steps(s: dict[str, Any]) -> int:
    """Decode steps run so far, from an ``/engine_stats`` answer."""
    return sum(s["batch_size_counts"].values())


async def wait_running(url: str, n: int) -> dict[str, Any]:
    """Until ``n`` requests are decoding and at least two steps ran with them (60 s bound)."""
    with trio.fail_after(60):
        while True:
            s = await stats(url)
            if s["num_requests_running"] >= n:
                first = steps(s)
                while steps(s) < first + 2:
                    await trio.sleep(0.02)
                    s = await stats(url)
                return s
            await trio.sleep(0.02)
