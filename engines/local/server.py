"""The reference engine's HTTP server: a hand-written ASGI app speaking vLLM's protocol.

Routes (vLLM's shapes; see ``docs/engines.md`` for the version followed):

- data plane: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``,
  ``POST /v1/chat/completions`` (both also streamed with ``stream=true``: server-sent
  events, :mod:`engines.local.streaming`), and the token-in ``POST /inference/v1/generate``
  (:mod:`engines.local.token_protocol`; as ``vllm serve --enable-scale-out``, not streamed);
- control plane (vLLM dev mode): ``POST /pause?mode=keep|abort|wait``, ``POST /resume``,
  ``GET /is_paused``, ``POST /sleep?level=1|2``, ``POST /wake_up[?tags=...]``,
  ``GET /is_sleeping``, ``POST /reset_prefix_cache``, ``GET /get_world_size``,
  ``POST /weight_checker``, and the weight-transfer routes of :mod:`engines.local.weight_routes`;
- ours: ``GET /metrics`` (Prometheus text), ``GET /engine_stats`` (JSON: batch-size
  histogram, queue lengths, weight version) and ``GET /control_log`` (the control-plane
  calls received, in order: the last :data:`CONTROL_LOG_SIZE`).

``weight_transfer_routes=False`` (``serve --no-weight-transfer``) drops the weight-transfer
routes (404), as a ``vllm serve`` without ``--weight-transfer-config``.

Every error is a vLLM ``ErrorResponse`` body. Bad input is a 4xx; a 5xx means a bug here
(or an injected fault). Model compute runs in the engine's worker threads, never on the
event loop.

Who may call what:

- with an API key (``serve --api-key``, or ``VLLM_API_KEY``), every route but the health probe
  (:data:`PROBE_PATHS`: ``GET /health``) needs ``Authorization: Bearer KEY``; without it the
  answer is a 401 before the body is read, whatever the path (unknown ones included), so a
  caller without the key learns nothing of the routes. Unlike vLLM, whose key guards only
  ``/v1``, ``/v2``, ``/inference`` and ``/cohere``, the control plane, the weight-transfer
  and LoRA routes and ours (``/metrics``, ``/engine_stats``, ``/control_log``) are guarded too;
- without a key, ``control_without_key=False`` (``serve``'s default, unless
  ``--allow-keyless-control``) serves the probe and the data plane
  (:data:`KEYLESS_PATHS`) and answers 403 to every other route, saying how to open it: on a
  host other users share, a keyless control plane would let any of them change the weights.
  An app made in-process (tests) serves everything without a key unless told otherwise.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypedDict
from urllib.parse import parse_qs, urlencode

import trio

from engines.local.completion_routes import CompletionRoutes
from engines.local.control_routes import CONTROL_ROUTES, ControlHandler
from engines.local.engine import LocalEngine
from engines.local.http import (
    BodyTooLarge,
    Request,
    Response,
    answer_lifespan,
    error_response,
    json_response,
    read_body,
)
from engines.local.lora_routes import LoraRoutes
from engines.local.protocol import (
    ProtocolError,
)
from engines.local.token_protocol import GENERATE_PATH
from engines.local.weight_routes import (
    WEIGHT_TRANSFER_PATHS,
    WeightReceiver,
    handle_weight_transfer,
)
from trainer.vocabulary import at_step, fire_fault

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope

__all__ = [
    "CONTROL_LOG_SIZE",
    "CONTROL_PLANE_PATHS",
    "KEYLESS_CLOSED",
    "KEYLESS_PATHS",
    "PROBE_PATHS",
    "UNAUTHORIZED",
    "EngineStats",
    "Request",
    "Response",
    "ServerApp",
    "error_response",
]

log = logging.getLogger(__name__)

Handler = Callable[["ServerApp", Request], Awaitable[Response]]

#: Control-plane calls ``GET /control_log`` keeps (the oldest are dropped).
CONTROL_LOG_SIZE = 1000


SLEEP_PATHS = ("/sleep", "/wake_up")
#: The refusal of ``/sleep`` and ``/wake_up`` by a server started without sleep mode.
SLEEP_MODE_OFF = (
    "sleep mode is off: start the server with --enable-sleep-mode (vLLM's CPU build has no "
    "sleep mode: there, /sleep answers 200, sleeps nothing, and completions wait until /wake_up)"
)


#: The answer to a request without the server's API key (vLLM says ``Unauthorized``).
UNAUTHORIZED = "Unauthorized: send Authorization: Bearer <api key>"
#: The answer of a server without an API key to a route it keeps closed.
KEYLESS_CLOSED = (
    "this server has no API key, so its control, weight-transfer, LoRA and statistics "
    "routes are closed: start it with --api-key (or VLLM_API_KEY) and send "
    "Authorization: Bearer <key>, or with --allow-keyless-control where every user who can "
    "reach its port may change its weights"
)


class EngineStats(TypedDict):
    """``GET /engine_stats``: the engine's state, for a debugger and the benchmarks."""

    #: Decode steps run, by batch size (the JSON keys are the sizes as strings).
    batch_size_counts: dict[str, int]
    num_requests_running: int
    num_requests_waiting: int
    is_paused: bool
    is_sleeping: bool
    weight_version: int


class ServerApp(CompletionRoutes, LoraRoutes):
    """ASGI app over one :class:`LocalEngine` (whose scheduler runs elsewhere)."""

    def __init__(
        self,
        engine: LocalEngine,
        *,
        served_model: str,
        api_key: str | None = None,
        control_without_key: bool = True,
        weight_transfer_routes: bool = True,
        weight_receiver: WeightReceiver | None = None,
        sleep_mode: bool = False,
        lora_routes: bool = False,
    ) -> None:
        self.engine = engine
        #: ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` served (``--enable-lora``
        #: with VLLM_ALLOW_RUNTIME_LORA_UPDATING, as vLLM); else 404.
        self.lora_routes = lora_routes
        #: False (``serve`` without ``--enable-sleep-mode``): ``/sleep`` and ``/wake_up`` are
        #: refused, where vLLM cannot sleep (its CPU build answers 200 and does nothing).
        self.sleep_mode = sleep_mode
        self.served_model = served_model
        self.api_key = api_key
        #: The sha256 of ``Bearer KEY``, compared in constant time; None: no key.
        self._auth_digest = (
            hashlib.sha256(f"Bearer {api_key}".encode()).digest() if api_key is not None else None
        )
        #: Without a key: serve the routes outside :data:`KEYLESS_PATHS` (else 403).
        self.control_without_key = control_without_key
        #: False: the weight-transfer routes answer 404 (no ``--weight-transfer-config``).
        self.weight_transfer_routes = weight_transfer_routes
        self.max_model_len = engine.max_model_len
        #: State of the weight-transfer protocol (:mod:`engines.local.weight_routes`).
        self.weight_receiver = weight_receiver or WeightReceiver()
        #: The last control-plane POSTs received, in order: ``/pause?mode=keep``, ...
        self.control_log: deque[str] = deque(maxlen=CONTROL_LOG_SIZE)
        #: Control-plane calls received since start (the log keeps the last ones).
        self.control_calls = 0

    # -- ASGI -----------------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        response = await self._handle(scope, receive)
        if response is None:  # the client went away mid-request
            return
        headers = [(b"content-type", response.content_type.encode())]
        if response.stream is None:
            headers.append((b"content-length", str(len(response.body)).encode()))
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        if response.stream is None:
            await send({"type": "http.response.body", "body": response.body, "more_body": False})
            return

        async def write(chunk: bytes) -> None:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})

        async def stream() -> Response:
            assert response.stream is not None
            await response.stream(write)
            return response

        if await self._until_disconnect(stream, receive) is not None:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _handle(self, scope: HTTPScope, receive: ASGIReceiveCallable) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        if scope["path"] not in PROBE_PATHS and not self._authorized(headers):
            return error_response(401, UNAUTHORIZED)  # before reading a stranger's body
        try:
            body = await read_body(receive)
        except BodyTooLarge as exc:
            return error_response(413, str(exc))
        if body is None:
            return None
        request = Request(
            method=scope["method"],
            path=scope["path"],
            query=parse_qs(scope.get("query_string", b"").decode("latin-1")),
            headers=headers,
            body=body,
        )
        handler = self._route(request)
        if isinstance(handler, Response):
            return handler
        try:
            if request.path in CONTROL_PLANE_PATHS:
                if request.method == "POST":  # not a probe's GET
                    self._record_control_call(request)
                # TRAINER_FAULTS fire where the work runs (a weight route's inside its call,
                # which its failure ends as any failure of the call: weight_routes)
                if request.path not in WEIGHT_TRANSFER_PATHS:
                    await fire_fault(request.path, request.step)
            if request.path in GENERATION_PATHS:
                with at_step(request.step):  # the step a generate fault fires at
                    return await self._until_disconnect(lambda: handler(self, request), receive)
            return await handler(self, request)
        except ProtocolError as exc:
            return json_response(exc.body(), exc.status)
        except Exception as exc:
            log.exception("%s %s failed", request.method, request.path)
            return error_response(500, f"{type(exc).__name__}: {exc}")

    def _authorized(self, headers: dict[str, str]) -> bool:
        """Whether the request may pass: no key is set, or it sends ``Bearer KEY`` (the scheme
        in any case, as vLLM reads it); compared as digests, in constant time."""
        if self._auth_digest is None:
            return True
        scheme, _, token = headers.get("authorization", "").partition(" ")
        sent = hashlib.sha256(f"Bearer {token}".encode("utf-8", "replace")).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(sent, self._auth_digest)

    def _record_control_call(self, request: Request) -> None:
        query = urlencode(request.query, doseq=True)
        self.control_log.append(f"{request.path}?{query}" if query else request.path)
        self.control_calls += 1

    def _route(self, request: Request) -> Handler | Response:
        """The request's handler, or the refusal: 404, 405, 403 (a keyless server's closed
        route), 400 (sleep routes without sleep mode)."""
        handler = self._find(request)
        if isinstance(handler, Response):
            return handler
        keyless = self.api_key is None and not self.control_without_key
        if keyless and request.path not in KEYLESS_PATHS:
            return error_response(403, KEYLESS_CLOSED)
        if request.path in SLEEP_PATHS and not self.sleep_mode:
            return error_response(400, SLEEP_MODE_OFF)
        return handler

    def _find(self, request: Request) -> Handler | Response:
        if request.path in WEIGHT_TRANSFER_PATHS and self.weight_transfer_routes:
            return ServerApp.weight_transfer
        methods = ROUTES.get(request.path)
        if methods is None or (request.path in LORA_PATHS and not self.lora_routes):
            return error_response(404, f"no route {request.path}")
        handler = methods.get(request.method)
        if handler is None:
            allowed = ", ".join(sorted(methods))
            return error_response(
                405, f"{request.method} {request.path}: method not allowed ({allowed})"
            )
        return handler

    async def _until_disconnect(
        self, handler: Callable[[], Awaitable[Response]], receive: ASGIReceiveCallable
    ) -> Response | None:
        """Run ``handler()``; if the client disconnects first, cancel it (its requests leave
        the batch) and return None. The handler's own errors propagate unwrapped."""
        result: Response | None = None
        error: Exception | None = None
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                result = await handler()
            except Exception as exc:
                error = exc
            nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return result

    # -- data plane -------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(200)

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.served_model,
            "object": "model",
            "created": 0,
            "owned_by": "vllm",
            "root": str(self.engine.model_dir),
            "parent": None,
            "max_model_len": self.max_model_len,
        }
        return json_response({"object": "list", "data": [card, *self.adapter_cards()]})

    async def weight_transfer(self, request: Request) -> Response:
        """One of the weight-transfer routes (:mod:`engines.local.weight_routes`)."""
        return await handle_weight_transfer(self.engine, self.weight_receiver, request)

    # -- ours -------------------------------------------------------------------------------------

    def _stats(self) -> EngineStats:
        e = self.engine
        return {
            "batch_size_counts": {str(k): v for k, v in sorted(e.batch_size_counts.items())},
            "num_requests_running": e.num_running,
            "num_requests_waiting": e.num_waiting,
            "is_paused": e.is_paused,
            "is_sleeping": e.is_sleeping,
            "weight_version": e.weight_version,
        }

    async def engine_stats(self, request: Request) -> Response:
        return json_response(self._stats())

    async def control_log_route(self, request: Request) -> Response:
        """``{"calls": [...], "total": N}``: the last control-plane POSTs, oldest first, and
        how many were received since start (a test diffs two answers by ``total``)."""
        return json_response({"calls": list(self.control_log), "total": self.control_calls})

    async def metrics(self, request: Request) -> Response:
        s = self._stats()
        lines = [
            "# TYPE vllm:num_requests_running gauge",
            f'vllm:num_requests_running{{model_name="{self.served_model}"}} {s["num_requests_running"]}',
            "# TYPE vllm:num_requests_waiting gauge",
            f'vllm:num_requests_waiting{{model_name="{self.served_model}"}} {s["num_requests_waiting"]}',
            "# HELP engine_decode_steps_total Decode steps run, by batch size (reference engine).",
            "# TYPE engine_decode_steps_total counter",
            *(
                f'engine_decode_steps_total{{batch_size="{k}"}} {v}'
                for k, v in s["batch_size_counts"].items()
            ),
        ]
        return Response(200, ("\n".join(lines) + "\n").encode(), "text/plain; version=0.0.4")


def _control(handler: ControlHandler) -> Handler:
    async def route(app: ServerApp, request: Request) -> Response:
        return await handler(app.engine, request)

    return route


ROUTES: dict[str, dict[str, Handler]] = {
    "/health": {"GET": ServerApp.health},
    "/v1/models": {"GET": ServerApp.models},
    "/v1/completions": {"POST": ServerApp.completions},
    "/v1/chat/completions": {"POST": ServerApp.chat_completions},
    GENERATE_PATH: {"POST": ServerApp.generate_tokens},
    "/v1/load_lora_adapter": {"POST": ServerApp.load_lora_adapter},
    "/v1/unload_lora_adapter": {"POST": ServerApp.unload_lora_adapter},
    **{
        path: {method: _control(h) for method, h in methods.items()}
        for path, methods in CONTROL_ROUTES.items()
    },
    "/metrics": {"GET": ServerApp.metrics},
    "/engine_stats": {"GET": ServerApp.engine_stats},
    "/control_log": {"GET": ServerApp.control_log_route},
}

#: The LoRA routes (:mod:`engines.local.lora_routes`): 404 unless the server serves them.
LORA_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})

#: Routes that generate: cancelled when their client disconnects.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", GENERATE_PATH})

#: Health probes: answered without the API key (launchers and load balancers poll them).
#: vLLM leaves more open (``/ping``, ``/version``, ``/metrics``, its dev routes); the reference
#: serves none of those but ``/metrics``, which needs the key here.
PROBE_PATHS = frozenset({"/health"})

#: What a server without an API key serves unless told otherwise: the probe and the data plane
#: (what vLLM's key would guard, and what ``vllm serve`` without one serves to anyone).
KEYLESS_PATHS = frozenset({*PROBE_PATHS, "/v1/models", *GENERATION_PATHS})

#: Routes where ``TRAINER_FAULTS`` may fire: the control-plane operations of DESIGN 4.3.
CONTROL_PLANE_PATHS = frozenset(
    {"/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache", *WEIGHT_TRANSFER_PATHS}
)
