"""The run's secret on every route of ``vllm serve`` but its health probes.

vLLM's own ``--api-key`` (and ``VLLM_API_KEY``) guards only the paths under ``/v1``, ``/v2``,
``/inference`` and ``/cohere`` (vLLM 0.32/0.33,
``vllm/entrypoints/serve/middleware/authenticate.py``): the development routes that
``VLLM_SERVER_DEV_MODE=1`` serves (``/pause``, ``/sleep``, ``/collective_rpc``,
``/init_weight_transfer_engine``, ``/update_weights`` — which unpickles its body when
``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, as ``sync.transport=ipc`` needs) take no key at all.
:class:`BearerAuthMiddleware`, given to ``vllm serve`` with ``--middleware`` (its import path,
:data:`MIDDLEWARE`), asks every HTTP request and websocket but :data:`HEALTH_PATHS` for
``Authorization: Bearer $VLLM_API_KEY``::

    VLLM_API_KEY=... PYTHONPATH=/path/to/this/checkout \\
        vllm serve MODEL --middleware engines.vllm.auth.BearerAuthMiddleware

A request without it is answered ``401 {"error": "Unauthorized"}`` (vLLM's own refusal,
word for word) before the route sees it; a websocket is closed (1008, policy violation). The
comparison is constant-time (the SHA-256 of each side, as vLLM's own). Without
``VLLM_API_KEY`` the server does not start (a guard with no key would let everyone in).
Imports nothing but the standard library: it runs inside vLLM's own environment.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

__all__ = ["HEALTH_PATHS", "MIDDLEWARE", "BearerAuthMiddleware"]

#: What ``vllm serve`` gets as ``--middleware``.
MIDDLEWARE = "engines.vllm.auth.BearerAuthMiddleware"
#: The probes that answer without the key: vLLM's liveness route and SageMaker's ``/ping``
#: (GET and POST), which say nothing but "up".
HEALTH_PATHS = frozenset({"/health", "/ping"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

_UNAUTHORIZED = json.dumps({"error": "Unauthorized"}).encode()


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()


class BearerAuthMiddleware:
    """ASGI middleware: the key of ``VLLM_API_KEY`` on every route but :data:`HEALTH_PATHS`.

    ``RuntimeError`` at construction (vLLM builds its middleware as it starts) when
    ``VLLM_API_KEY`` is unset or empty.
    """

    def __init__(self, app: App) -> None:
        key = os.environ.get("VLLM_API_KEY", "")
        if not key:
            raise RuntimeError(
                f"{MIDDLEWARE} needs VLLM_API_KEY: set it in the server's environment (the "
                "trainer does for the servers it starts), or drop --middleware"
            )
        self.app = app
        self._expected = _digest(f"Bearer {key}")

    def authorized(self, scope: Scope) -> bool:
        """Whether ``scope``'s ``Authorization`` header is ``Bearer KEY`` (constant time)."""
        given = ""
        for name, value in scope.get("headers", ()):
            if name.lower() == b"authorization":
                given = value.decode("latin-1")
                break
        return hmac.compare_digest(_digest(given), self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"].removeprefix(scope.get("root_path", "")) or "/"
        if path in HEALTH_PATHS or self.authorized(scope):
            await self.app(scope, receive, send)
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1008})
        else:
            await _refuse(send)


async def _refuse(send: Send) -> None:
    """vLLM's own 401 answer."""
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(_UNAUTHORIZED)).encode()),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": _UNAUTHORIZED})
