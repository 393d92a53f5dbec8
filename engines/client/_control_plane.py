"""The control-plane half of the client: one request fanned out to every server at once.

::

    async with ControlPlane(urls, control_plane_timeout_s=60) as servers:
        await servers.pause("keep")                  # every server, concurrently
        await servers.control_one(urls[0], "POST", "/init_weight_transfer_engine",
                                  json={"init_info": info})   # one server
        await servers.resume()

:class:`~engines.client.InferenceClient` is a ``ControlPlane`` with the data plane added.

Each request runs inside ``operation(path)`` and is bounded by ``control_plane_timeout_s``
with a trio cancel scope (so a server that accepts the connection and never answers is
caught) -> :class:`~trainer.errors.InferenceServerTimeoutError`. Only connection failures
(the request never reached the server) are retried. A non-2xx answer or a malformed body
raises :class:`~trainer.errors.InferenceServerError` (see ``engines.client._requests``). When
several servers fail one fan-out, every call still runs to its end; then the first failure
(in URL order) is raised with the others attached as notes.
"""

from __future__ import annotations

import math
import os
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Self, TypeVar

import httpx
import trio

from engines.client._requests import CONNECT_ERRORS, DEFAULT_RETRY, RetryPolicy, decode_json, send
from engines.client._rotation import Rotation
from engines.client._route_methods import ControlRoutes
from engines.client._routes import DATA_PLANE_ROUTES, PAUSE_ROUTES, probe
from engines.types import JSONValue, QueryParams
from trainer.errors import ConfigError, InferenceServerError, InferenceServerTimeoutError
from trainer.vocabulary import operation, raise_first

T = TypeVar("T")

__all__ = [
    "CONTROL_PLANE_TIMEOUT_ENV",
    "DEFAULT_CONTROL_PLANE_TIMEOUT_S",
    "ControlPlane",
    "bounded_control",
    "resolve_control_plane_timeout",
]


#: Default bound of one control-plane request (``engine.control_plane_timeout_s``).
DEFAULT_CONTROL_PLANE_TIMEOUT_S = 600.0
#: Environment variable that overrides ``engine.control_plane_timeout_s``.
CONTROL_PLANE_TIMEOUT_ENV = "TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S"


def resolve_control_plane_timeout(config_value: float | None) -> float | None:
    """The control-plane timeout in seconds, or None for unbounded.

    ``config_value`` as given; unset (None), ``TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S``
    when set and non-empty, else 600 s. A value <= 0 (or infinite) disables the bound. The
    trainer passes the run plan's value, the environment already applied there once (by the
    config loader, ``engine.control_plane_timeout_s``'s override). Raises ``ConfigError`` when
    the environment variable is read and is not a number.
    """
    raw = os.environ.get(CONTROL_PLANE_TIMEOUT_ENV, "").strip() if config_value is None else ""
    if raw:
        try:
            value = float(raw)
        except ValueError:
            raise ConfigError(
                f"{CONTROL_PLANE_TIMEOUT_ENV}={raw!r} is not a number of seconds "
                "(<= 0 disables the control-plane timeout)"
            ) from None
    elif config_value is not None:
        value = float(config_value)
    else:
        value = DEFAULT_CONTROL_PLANE_TIMEOUT_S
    if math.isnan(value):
        raise ConfigError("engine.control_plane_timeout_s must be a number, not NaN")
    return value if 0 < value < math.inf else None


async def bounded_control(
    url: str, path: str, timeout_s: float | None, call: Callable[[], Awaitable[T]]
) -> T:
    """``await call()`` as control call ``path`` to ``url``: inside ``operation(path)``, and
    past ``timeout_s`` (None: unbounded) an ``InferenceServerTimeoutError`` naming both."""
    with operation(path):
        with trio.move_on_after(math.inf if timeout_s is None else timeout_s) as scope:
            return await call()
        assert scope.cancelled_caught and timeout_s is not None
        raise InferenceServerTimeoutError(url, path, timeout_s)


class ControlPlane(ControlRoutes):
    """Drives the control routes of N inference servers (reference or vLLM) over HTTP.

    Use as ``async with ControlPlane(urls) as servers:`` or call :meth:`aclose`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        control_plane_timeout_s: float | None = None,
        retry: RetryPolicy = DEFAULT_RETRY,
        connect_timeout_s: float = 10.0,
    ) -> None:
        """``control_plane_timeout_s`` is resolved by :func:`resolve_control_plane_timeout`
        (the env var wins; None means 600 s; <= 0 disables); ``retry``: how failed connections
        are retried. ``ValueError`` for no URLs."""
        if not urls:
            raise ValueError("InferenceClient needs at least one server URL")
        #: The servers by index, their states and requests (:class:`engines.client.Rotation`).
        self.rotation = Rotation(urls)
        self.control_plane_timeout_s = resolve_control_plane_timeout(control_plane_timeout_s)
        #: How a request is sent again after a transport error (each request says which).
        self.retry = retry
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Control-plane calls get their own pool, so a /pause never waits behind frozen
        # generation requests holding every data-plane connection. It keeps no connection
        # alive: real vLLM resets a connection after answering a failed route 500, and the
        # next request sent on it would fail (measured: "Connection reset by peer"). A
        # handful of control calls a step can afford a connection each.
        self._control_http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )

    @property
    def urls(self) -> list[str]:
        """The servers control calls reach, in index order: every server, but for one that
        failed and is not back yet (:attr:`rotation`)."""
        return self.rotation.members

    @property
    def headers(self) -> dict[str, str]:
        """The headers every request to the servers carries (the API key, if any)."""
        return dict(self._headers)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool (idempotent)."""
        await self._control_http.aclose()

    # -- one server, every server -----------------------------------------------------------------

    async def control_one(
        self,
        url: str,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> JSONValue:
        """Send one control-plane request to the server at ``url``; its 2xx answer's JSON body
        (None when empty).

        Runs in ``operation(path)``, bounded by ``control_plane_timeout_s``
        (``InferenceServerTimeoutError``); ``InferenceServerError`` for a non-2xx answer, a
        body that is not JSON, or a connection that still fails after the retries.
        """

        async def call() -> JSONValue:
            response = await send(
                self._control_http,
                url,
                method,
                path,
                headers=self._headers,
                retry=self.retry,
                retry_on=CONNECT_ERRORS,
                params=params,
                json_body=json,
            )
            return decode_json(url, path, response)

        return await bounded_control(url, path, self.control_plane_timeout_s, call)

    async def control(
        self,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> list[JSONValue]:
        """Send one control-plane request to every server concurrently; the 2xx answers' JSON
        bodies, in URL order.

        Each call is a :meth:`control_one`. Every call runs to its end even when another
        fails; then the first failure (URL order) is raised, the others as its notes.
        """
        urls = self.urls
        results: list[JSONValue] = [None] * len(urls)
        errors: dict[int, Exception] = {}

        async def one(i: int, url: str) -> None:
            try:
                results[i] = await self.control_one(url, method, path, params, json)
            except Exception as exc:
                errors[i] = exc

        async with trio.open_nursery() as nursery:
            for i, url in enumerate(urls):
                nursery.start_soon(one, i, url)
        if errors:
            raise_first([errors[i] for i in sorted(errors)])
        return results

    # -- the routes beyond ControlRoutes' -------------------------------------------------------

    async def max_model_len(self) -> int | None:
        """The shortest context of the servers (prompt plus completion tokens a request may
        hold): ``GET /v1/models``'s ``max_model_len``, which vLLM and the reference server
        report; None when no server reports one (an OpenAI-compatible server that is not vLLM).
        """
        path = "/v1/models"
        lengths = []
        for url, body in zip(self.urls, await self.control("GET", path)):
            models = body.get("data") if isinstance(body, dict) else None
            if not isinstance(models, list) or not models or not isinstance(models[0], dict):
                raise InferenceServerError(url, path, 200, f"not a model list: {body!r:.200}")
            length = models[0].get("max_model_len")
            if isinstance(length, int) and not isinstance(length, bool):
                lengths.append(length)
        return min(lengths) if lengths else None

    async def probe(self, required: Iterable[str] = (*DATA_PLANE_ROUTES, *PAUSE_ROUTES)) -> None:
        """Check that every server serves ``required`` routes; name the vllm flag when one is missing.

        See :func:`engines.client.probe` (side-effect free; 404 names the ``vllm serve``
        flag, 501 means present but not implemented; ``ValueError`` for an unknown route).
        """
        await probe(self, required)
