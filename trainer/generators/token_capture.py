"""A token-capturing OpenAI proxy in front of the run's engines, one per ``generate`` call.

::

    async with open_capture_proxy(engine, sampling) as proxy:
        base_url = proxy.base_url("7-0-1")      # http://127.0.0.1:PORT/t/7-0-1/v1
        ...                                     # an agent's OpenAI client talks to base_url
        turns = proxy.turns("7-0-1")            # what the engine returned, call by call

Why a proxy (and not a client-side hook): an agent is handed nothing but a ``base_url``, the
one setting every OpenAI client, agent framework and subprocess agent accepts, so the
trainer sees every call whatever client the agent builds; and the trajectory is in the
URL path, so no header has to survive the agent's client. It costs one extra localhost
hop per model call.

Each call (``POST .../chat/completions`` or ``.../completions``, streamed or not) goes to
the trajectory's engine (``InferenceClient.url_for``: sticky routing), rewritten so that:

- the engine returns token ids and logprobs (``return_token_ids``; ``logprobs``), which are
  recorded as :class:`~trainer.generators.turns.CapturedTurn` s and removed again from the
  answer if the agent did not ask for them;
- sampling is the run's: ``temperature`` and ``top_p`` are ``generator.sampling``'s (the
  trainer scores tokens at that temperature), ``max_tokens`` is capped at
  ``generator.sampling.max_tokens`` (and defaults to it), ``seed`` defaults to the
  trajectory's seed + the call's number; ``model`` is the engine's (any name is accepted).

``POST .../inference/v1/generate`` (the token-in route verifiers' training client calls) goes
the same way, rewritten and adapted as :mod:`trainer.generators.token_in` says, routed by the
request's ``X-Session-ID`` header where it has one (many sessions may share one base URL).

``GET .../models`` is forwarded. Errors of the engine (4xx, 5xx) pass through unrecorded.
Each forward runs inside ``operation("generate")``, where the ``generate`` fault fires, so a
step deadline that lands during a model call names it. The proxy serves (hypercorn, trio)
in a nursery the ``async with`` block owns; leaving the block stops it and cancels calls in
flight (their engine requests are dropped, and the reference engine aborts them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, unquote

import attrs
import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from engines.client import DATA_CONNECTIONS_PER_SERVER, InferenceClient
from engines.local.http import BodyTooLarge, answer_lifespan, read_body
from engines.types import SamplingParams
from trainer.generators.token_in import (
    TOKEN_IN_ROUTE,
    as_renderers_reads,
    rewrite_token_in,
    token_in_turns,
)
from trainer.generators.turns import CapturedTurn
from trainer.vocabulary import at_step, current_step, fire_fault, open_owner_nursery, operation

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, Scope

__all__ = ["ENGINE_KEEPALIVE_S", "PROXY_KEEPALIVE_S", "CaptureProxy", "open_capture_proxy"]

_CHAT, _COMPLETIONS, _MODELS = "/v1/chat/completions", "/v1/completions", "/v1/models"
#: Seconds the proxy keeps an agent's idle connection open: far longer than the clients'
#: own keep-alive (httpx: 5 s), so a client never sends a request on a connection the proxy
#: is closing (hypercorn's default is also 5 s: under load, agents' second calls failed with
#: ``ReadError`` on connections closed as they were reused).
PROXY_KEEPALIVE_S = 60.0
#: Seconds the proxy keeps an idle connection to an engine: under the servers' own 5 s
#: (hypercorn, uvicorn), for the same reason.
ENGINE_KEEPALIVE_S = 2.0
#: hypercorn's error log for the proxy: warnings and errors (not its "Running on" per step).
_SERVER_LOG = logging.getLogger(f"{__name__}.server")
_SERVER_LOG.setLevel(logging.WARNING)


@attrs.define
class _Call:
    """What the agent asked for that the proxy changes, to give it back as asked."""

    chat: bool
    wanted_logprobs: bool
    wanted_token_ids: bool


@attrs.define
class _Choice:
    """A streamed choice's tokens so far."""

    prompt_ids: list[int] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[float] = attrs.field(factory=list)
    finish_reason: str = "abort"


class CaptureProxy:
    """The proxy's ASGI app and its records; open with :func:`open_capture_proxy`."""

    def __init__(self, engine: InferenceClient, sampling: SamplingParams) -> None:
        self.engine = engine
        self.sampling = sampling
        #: Set by :func:`open_capture_proxy` once serving.
        self.url = ""
        self._turns: dict[str, list[CapturedTurn]] = {}
        self._seeds: dict[str, int] = {}
        self._calls: dict[str, int] = {}
        self._steps: dict[str, int | None] = {}
        # bounded as the engine client's pool is (httpcore scans every connection per request)
        connections = DATA_CONNECTIONS_PER_SERVER * len(engine.urls)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0),
            limits=httpx.Limits(
                max_connections=connections,
                max_keepalive_connections=connections,
                keepalive_expiry=ENGINE_KEEPALIVE_S,
            ),
        )

    def register(self, trajectory_id: str, seed: int) -> str:
        """Accept calls for ``trajectory_id`` (seeded from ``seed``); its base URL. Its calls
        belong to the caller's step (:func:`~trainer.vocabulary.current_step`: where the
        ``generate`` fault fires), also when the proxy outlives the step; registering again
        starts its record and its call count afresh."""
        self._turns[trajectory_id] = []
        self._seeds[trajectory_id] = seed
        self._calls[trajectory_id] = 0
        self._steps[trajectory_id] = current_step()
        return self.base_url(trajectory_id)

    def base_url(self, trajectory_id: str) -> str:
        """The OpenAI ``base_url`` of a trajectory (ends in ``/v1``)."""
        return f"{self.url}/t/{quote(trajectory_id, safe='')}/v1"

    def turns(self, trajectory_id: str) -> list[CapturedTurn]:
        """The trajectory's model calls so far, in the order they finished."""
        return list(self._turns.get(trajectory_id, ()))

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- ASGI -------------------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        try:
            body = await read_body(receive)
        except BodyTooLarge as exc:
            await _send_json(send, 413, _error(413, str(exc)))
            return
        if body is None:
            return
        parts = scope["path"].split("/", 3)  # "", "t", id, rest
        key = unquote(parts[2]) if len(parts) == 4 and parts[1] == "t" else None
        route = "/" + parts[3] if key is not None else ""
        if key not in self._turns or route not in (_CHAT, _COMPLETIONS, _MODELS, TOKEN_IN_ROUTE):
            await _send_json(send, 404, _error(404, f"no route {scope['path']}"))
            return
        assert key is not None
        if route == _MODELS:
            response = await self._http.get(
                f"{self.engine.url_for(key)}{_MODELS}", headers=self.engine.headers
            )
            await _send_json(send, response.status_code, response.content)
            return
        try:
            request = json.loads(body)
            if not isinstance(request, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            await _send_json(send, 400, _error(400, f"the request body is not valid JSON: {exc}"))
            return
        if route == TOKEN_IN_ROUTE:
            session = dict(scope["headers"]).get(b"x-session-id", b"").decode("latin-1")
            await self._token_in(key, request, send, session or key)
            return
        call = self._rewrite(key, request, chat=route == _CHAT)
        url = f"{self.engine.url_for(key)}{route}"
        with at_step(self._steps[key]), operation("generate"):
            await fire_fault("generate")
            if request.get("stream"):
                await self._stream(key, call, url, request, send)
            else:
                await self._whole(key, call, url, request, send)

    def _rewrite(self, key: str, request: dict[str, Any], *, chat: bool) -> _Call:
        call = _Call(
            chat=chat,
            wanted_logprobs=bool(request.get("logprobs"))
            if chat
            else request.get("logprobs") is not None,
            wanted_token_ids=bool(request.get("return_token_ids")),
        )
        s = self.sampling
        request["return_token_ids"] = True
        request["logprobs"] = True if chat else (request.get("logprobs") or 0)
        request["temperature"] = s.temperature
        request["top_p"] = s.top_p
        if request.get("seed") is None:
            request["seed"] = (self._seeds[key] + self._calls[key]) % 2**63
        self._calls[key] += 1
        for name in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
            if request.get(name) is not None:
                request[name] = min(int(request[name]), s.max_tokens)
        if not any(request.get(n) is not None for n in ("max_completion_tokens", "max_tokens")):
            request["max_tokens"] = s.max_tokens
        if self.engine.model is not None:
            request["model"] = self.engine.model
        else:
            request.pop("model", None)
        return call

    async def _token_in(
        self, key: str, request: dict[str, Any], send: ASGISendCallable, route_key: str
    ) -> None:
        """``POST .../inference/v1/generate`` (:mod:`trainer.generators.token_in`), to the
        engine of ``route_key`` (the client's ``X-Session-ID`` when it sends one: verifiers
        sends its trace's id, so each episode stays on one engine), recorded under ``key``."""
        if request.get("stream"):
            await _send_json(send, 400, _error(400, "the proxy does not stream the token-in route"))
            return
        wanted = rewrite_token_in(
            request, self.sampling, (self._seeds[key] + self._calls[key]) % 2**63, self.engine.model
        )
        self._calls[key] += 1
        url = f"{self.engine.url_for(route_key)}{TOKEN_IN_ROUTE}"
        with at_step(self._steps[key]), operation("generate"):
            await fire_fault("generate")
            response = await self._http.post(url, json=request, headers=self.engine.headers)
        if response.status_code != 200:
            await _send_json(send, response.status_code, response.content)
            return
        data = response.json()
        self._turns[key] += token_in_turns(request, data)
        await _send_json(send, 200, json.dumps(as_renderers_reads(data, wanted)).encode())

    async def _whole(
        self, key: str, call: _Call, url: str, request: dict[str, Any], send: ASGISendCallable
    ) -> None:
        response = await self._http.post(url, json=request, headers=self.engine.headers)
        if response.status_code != 200:
            await _send_json(send, response.status_code, response.content)
            return
        data = response.json()
        for choice in data["choices"]:
            prompt = data.get("prompt_token_ids") if call.chat else choice["prompt_token_ids"]
            self._turns[key].append(
                CapturedTurn(
                    [int(t) for t in prompt],
                    [int(t) for t in choice["token_ids"]],
                    _logprobs(choice, call.chat),
                    choice["finish_reason"] or "abort",
                )
            )
        await _send_json(send, 200, json.dumps(_as_asked(data, call)).encode())

    async def _stream(
        self, key: str, call: _Call, url: str, request: dict[str, Any], send: ASGISendCallable
    ) -> None:
        choices: dict[int, _Choice] = {}
        prompt_ids: list[int] = []
        async with self._http.stream(
            "POST", url, json=request, headers=self.engine.headers
        ) as response:
            if response.status_code != 200:
                await _send_json(send, response.status_code, await response.aread())
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")],
                }
            )
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line.removeprefix("data: ")
                if payload != "[DONE]":
                    chunk = json.loads(payload)
                    prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
                    for choice in chunk.get("choices") or ():
                        self._record_piece(choices, choice, call.chat)
                    payload = json.dumps(_as_asked(chunk, call))
                event = f"data: {payload}\n\n".encode()
                await send({"type": "http.response.body", "body": event, "more_body": True})
        for _, c in sorted(choices.items()):
            self._turns[key].append(
                CapturedTurn(c.prompt_ids or prompt_ids, c.token_ids, c.logprobs, c.finish_reason)
            )
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    def _record_piece(choices: dict[int, _Choice], choice: dict[str, Any], chat: bool) -> None:
        c = choices.setdefault(int(choice["index"]), _Choice())
        if choice.get("prompt_token_ids"):
            c.prompt_ids = [int(t) for t in choice["prompt_token_ids"]]
        c.token_ids += [int(t) for t in choice.get("token_ids") or ()]
        if choice.get("logprobs"):
            c.logprobs += _logprobs(choice, chat)
        if choice.get("finish_reason"):
            c.finish_reason = choice["finish_reason"]


def _logprobs(choice: dict[str, Any], chat: bool) -> list[float]:
    block = choice["logprobs"]
    if chat:
        return [float(e["logprob"]) for e in block["content"] or ()]
    return [float(lp) for lp in block["token_logprobs"]]


def _as_asked(data: dict[str, Any], call: _Call) -> dict[str, Any]:
    """The engine's answer with what the proxy added for itself taken out again."""
    if not call.wanted_token_ids and "prompt_token_ids" in data:
        data["prompt_token_ids"] = None
    for choice in data.get("choices") or ():
        if not call.wanted_token_ids:
            for name in ("token_ids", "prompt_token_ids"):
                if name in choice:
                    choice[name] = None
        if not call.wanted_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    return data


def _error(status: int, message: str) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    ).encode()


async def _send_json(send: ASGISendCallable, status: int, body: bytes) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})


@asynccontextmanager
async def open_capture_proxy(
    engine: InferenceClient, sampling: SamplingParams
) -> AsyncIterator[CaptureProxy]:
    """Serve a :class:`CaptureProxy` on 127.0.0.1 (a free port) for the block."""
    proxy = CaptureProxy(engine, sampling)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 0.1
    config.keep_alive_timeout = PROXY_KEEPALIVE_S
    config.accesslog = None
    config.errorlog = _SERVER_LOG  # a failing call lands in the run's log
    shutdown = trio.Event()
    try:
        async with open_owner_nursery() as nursery:
            binds = await nursery.start(
                partial(serve, proxy, config, shutdown_trigger=shutdown.wait)
            )
            proxy.url = str(binds[0])
            try:
                yield proxy
            finally:
                shutdown.set()
                nursery.cancel_scope.cancel()  # calls in flight end with the block
    finally:
        with trio.CancelScope(shield=True):
            await proxy.aclose()
