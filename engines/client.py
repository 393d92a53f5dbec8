"""``InferenceClient``: one client for the reference servers and for real ``vllm serve``.

::

    async with InferenceClient(urls) as client:
        await client.probe()                          # fails with the vllm flag to set
        completion = await client.generate(prompt_ids, SamplingParams(max_tokens=64),
                                           trajectory_id="prompt-7/sample-2")
        await client.pause("keep")                    # every server, concurrently
        ...
        await client.resume()

Data plane (``generate``): each request goes to one server (the same one for the same
``trajectory_id``, round-robin without one), at most ``max_concurrency`` in flight. Only
transport errors are retried (bounded exponential backoff); an HTTP status never is. It is
bounded by nothing but the caller's cancel scopes (the step deadline).

Control plane (``pause``, ``resume``, ``sleep``, ``wake_up``, ... or ``control``): fans out to
every server at once, each call inside ``operation(path)`` and bounded by
``control_plane_timeout_s`` with a trio cancel scope (so a server that accepts the connection
and never answers is caught) -> :class:`~trainer.errors.InferenceServerTimeoutError`. Only
connection failures (the request never reached the server) are retried there.

Errors: a non-2xx answer or a malformed body raises
:class:`~trainer.errors.InferenceServerError` (URL, endpoint, status, body excerpt); a
transport failure after its retries raises it with ``status=None``. No httpx exception
escapes. When several servers fail one fan-out, the first (in URL order) is raised with the
others attached as notes.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import httpx
import trio

from engines.routes import (
    DATA_PLANE_ROUTES,
    PAUSE_ROUTES,
    ROUTE_FLAGS,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
    probe,
    raise_first,
)
from engines.types import Completion, SamplingParams
from trainer.errors import ConfigError, InferenceServerError, InferenceServerTimeoutError
from trainer.vocabulary import current_step, operation

__all__ = [
    "CONTROL_PLANE_TIMEOUT_ENV",
    "DATA_PLANE_ROUTES",
    "DEFAULT_CONTROL_PLANE_TIMEOUT_S",
    "PAUSE_ROUTES",
    "ROUTE_FLAGS",
    "SLEEP_ROUTES",
    "WEIGHT_TRANSFER_ROUTES",
    "InferenceClient",
    "resolve_control_plane_timeout",
]

PauseMode = Literal["keep", "abort", "wait"]

#: Default bound of one control-plane request (``engine.control_plane_timeout_s``).
DEFAULT_CONTROL_PLANE_TIMEOUT_S = 600.0
#: Environment variable that overrides ``engine.control_plane_timeout_s``.
CONTROL_PLANE_TIMEOUT_ENV = "TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S"
#: Characters of a response body carried by an ``InferenceServerError``.
BODY_EXCERPT_CHARS = 500
#: Header carrying the trainer's current step (the server fires injected faults with it).
STEP_HEADER = "X-Trainer-Step"

# Transport errors after which the request may be sent again. Control-plane requests retry
# only the first two kinds (the request never reached the server).
_CONNECT_ERRORS = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)
_RETRYABLE = (*_CONNECT_ERRORS, httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError)

#: Data-plane HTTP connections per server (requests beyond it queue in the client).
DATA_CONNECTIONS_PER_SERVER = 32


def resolve_control_plane_timeout(config_value: float | None) -> float | None:
    """The control-plane timeout in seconds, or None for unbounded.

    ``TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S`` (when set and non-empty) overrides
    ``config_value``; with neither, 600 s. A value <= 0 (or infinite) disables the bound.
    Raises ``ConfigError`` when the environment variable is not a number.
    """
    raw = os.environ.get(CONTROL_PLANE_TIMEOUT_ENV, "").strip()
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


def _excerpt(response: httpx.Response) -> str:
    """vLLM's error message when the body is an ``ErrorResponse``, else the start of the body."""
    text = response.text
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"][:BODY_EXCERPT_CHARS]
        if isinstance(err, str):
            return err[:BODY_EXCERPT_CHARS]
    except (ValueError, AttributeError):
        pass
    return text[:BODY_EXCERPT_CHARS] or "(empty body)"


class InferenceClient:
    """Drives N inference servers (reference or vLLM) over HTTP; see the module docstring.

    Use as ``async with InferenceClient(urls) as client:`` or call :meth:`aclose`.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        api_key: str | None = None,
        model: str | None = None,
        max_concurrency: int = 256,
        control_plane_timeout_s: float | None = None,
        max_retries: int = 3,
        backoff_s: float = 0.2,
        max_backoff_s: float = 2.0,
        connect_timeout_s: float = 10.0,
    ) -> None:
        """``control_plane_timeout_s`` is resolved by :func:`resolve_control_plane_timeout`
        (the env var wins; None means 600 s; <= 0 disables). ``model`` is sent as the
        completions ``model`` field (vLLM uses its served model when it is omitted).
        ``ValueError`` for no URLs or a non-positive ``max_concurrency``."""
        if not urls:
            raise ValueError("InferenceClient needs at least one server URL")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        self.urls = [u.rstrip("/") for u in urls]
        self.model = model
        self.control_plane_timeout_s = resolve_control_plane_timeout(control_plane_timeout_s)
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._limiter = trio.CapacityLimiter(max_concurrency)
        self._round_robin = itertools.count()
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # Generation shares a bounded pool: httpcore scans every idle connection on each
        # request, so a pool of hundreds makes a burst quadratic (measured: 128 concurrent
        # requests took 1.0-3.7 s with an unbounded pool, 0.7-0.9 s with 16-32 connections).
        # Control-plane calls get their own pool, so a /pause never waits behind frozen
        # generation requests holding every data-plane connection.
        per_server = min(max_concurrency, DATA_CONNECTIONS_PER_SERVER) * len(self.urls)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=per_server, max_keepalive_connections=per_server),
        )
        self._control_http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=4 * len(self.urls)),
        )

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pools (idempotent)."""
        await self._http.aclose()
        await self._control_http.aclose()

    # -- transport --------------------------------------------------------------------------------

    def url_for(self, trajectory_id: str | None) -> str:
        """The server of a trajectory: stable for one id (sha256, not ``hash``), round-robin for None."""
        if trajectory_id is None:
            return self.urls[next(self._round_robin) % len(self.urls)]
        digest = hashlib.sha256(str(trajectory_id).encode()).digest()
        return self.urls[int.from_bytes(digest[:8], "big") % len(self.urls)]

    def _request_headers(self) -> dict[str, str]:
        step = current_step()
        if step is None:
            return self._headers
        return {**self._headers, STEP_HEADER: str(step)}

    async def _send(
        self,
        url: str,
        method: str,
        path: str,
        *,
        params: Mapping[str, Any] | None = None,
        json_body: Any = None,
        retry_on: tuple[type[Exception], ...] = _RETRYABLE,
        control: bool = False,
    ) -> httpx.Response:
        """One request with transport retries; raises ``InferenceServerError`` for a non-2xx
        answer or when the transport still fails after ``max_retries`` retries."""
        attempt = 0
        while True:
            try:
                http = self._control_http if control else self._http
                response = await http.request(
                    method,
                    url + path,
                    params=params,
                    json=json_body,
                    headers=self._request_headers(),
                )
                break
            except retry_on as exc:
                if attempt >= self.max_retries:
                    raise InferenceServerError(
                        url,
                        path,
                        None,
                        f"transport error after {attempt + 1} attempts: {type(exc).__name__}: {exc}",
                    ) from None
                await trio.sleep(min(self.max_backoff_s, self.backoff_s * 2**attempt))
                attempt += 1
            except httpx.HTTPError as exc:
                raise InferenceServerError(
                    url, path, None, f"{type(exc).__name__}: {exc}"
                ) from None
        if not response.is_success:
            raise InferenceServerError(url, path, response.status_code, _excerpt(response))
        return response

    @staticmethod
    def _json(url: str, path: str, response: httpx.Response) -> Any:
        """The body as JSON; ``None`` for an empty body; ``InferenceServerError`` when malformed."""
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError:
            raise InferenceServerError(
                url,
                path,
                response.status_code,
                f"malformed JSON body: {response.text[:BODY_EXCERPT_CHARS]!r}",
            ) from None

    # -- data plane -------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        """Sample one completion of ``prompt_ids`` (``POST /v1/completions`` with token ids).

        Runs inside ``operation("generate")``; waits for a slot under the concurrency cap.
        Raises ``InferenceServerError`` for a 4xx/5xx (not retried: e.g. a sleeping engine
        answers 409), a body that is not a completion, or a transport failure after retries.
        On cancellation the HTTP request is dropped (the reference server then aborts it).
        """
        url = self.url_for(trajectory_id)
        body: dict[str, Any] = {
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos,
            "logprobs": 0,
            "return_token_ids": True,
            "n": 1,
        }
        if self.model is not None:
            body["model"] = self.model
        path = "/v1/completions"
        with operation("generate"):
            async with self._limiter:
                response = await self._send(url, "POST", path, json_body=body)
        return self._completion(url, path, self._json(url, path, response), prompt_ids)

    @staticmethod
    def _completion(url: str, path: str, data: Any, prompt_ids: list[int]) -> Completion:
        try:
            choice = data["choices"][0]
            token_ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
            finish_reason = choice["finish_reason"]
            prompt = choice.get("prompt_token_ids") or list(prompt_ids)
            if finish_reason not in ("stop", "length", "abort") or len(logprobs) != len(token_ids):
                raise ValueError(
                    f"finish_reason={finish_reason!r}, {len(logprobs)} logprobs for {len(token_ids)} tokens"
                )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            excerpt = json.dumps(data)[:BODY_EXCERPT_CHARS]
            raise InferenceServerError(
                url, path, 200, f"not a completion ({exc!r}): {excerpt}"
            ) from None
        return Completion(token_ids, logprobs, finish_reason, [int(t) for t in prompt])

    # -- control plane ----------------------------------------------------------------------------

    async def _control_one(
        self, url: str, method: str, path: str, params: Mapping[str, Any] | None, json_body: Any
    ) -> httpx.Response:
        timeout = self.control_plane_timeout_s
        with operation(path):
            with trio.move_on_after(math.inf if timeout is None else timeout) as scope:
                return await self._send(
                    url,
                    method,
                    path,
                    params=params,
                    json_body=json_body,
                    retry_on=_CONNECT_ERRORS,
                    control=True,
                )
            assert scope.cancelled_caught and timeout is not None
            raise InferenceServerTimeoutError(url, path, timeout)

    async def control(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
    ) -> list[httpx.Response]:
        """Send one control-plane request to every server concurrently; the 2xx responses, in URL order.

        Each call runs in ``operation(path)``, bounded by ``control_plane_timeout_s``
        (``InferenceServerTimeoutError``). Every call runs to its end even when another
        fails; then the first failure (URL order) is raised, the others as its notes.
        """
        results: list[httpx.Response | None] = [None] * len(self.urls)
        errors: list[tuple[int, Exception]] = []

        async def one(i: int, url: str) -> None:
            try:
                results[i] = await self._control_one(url, method, path, params, json)
            except Exception as exc:
                errors.append((i, exc))

        async with trio.open_nursery() as nursery:
            for i, url in enumerate(self.urls):
                nursery.start_soon(one, i, url)
        if errors:
            raise_first(errors)
        return [r for r in results if r is not None]

    async def control_json(
        self, method: str, path: str, params: Mapping[str, Any] | None = None, json: Any = None
    ) -> list[Any]:
        """:meth:`control`, each body decoded as JSON (None when empty)."""
        responses = await self.control(method, path, params, json)
        return [self._json(url, path, r) for url, r in zip(self.urls, responses)]

    def _field(self, values: list[Any], path: str, key: str, kind: type) -> list[Any]:
        out = []
        for url, value in zip(self.urls, values):
            if not isinstance(value, dict) or not isinstance(value.get(key), kind):
                raise InferenceServerError(
                    url, path, 200, f"expected a JSON object with {key!r}: {value!r:.200}"
                )
            out.append(value[key])
        return out

    async def pause(self, mode: PauseMode = "keep") -> None:
        """``POST /pause?mode=...`` on every server (keep: freeze, abort: end, wait: drain)."""
        await self.control("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """``POST /resume`` on every server."""
        await self.control("POST", "/resume")

    async def sleep(self, level: int = 1, mode: PauseMode | None = None) -> None:
        """``POST /sleep?level=...`` on every server (1: offload weights, 2: discard them).

        ``mode`` says what happens to in-flight requests, as for :meth:`pause`; None leaves
        it to the server (vLLM's default: abort)."""
        params: dict[str, Any] = {"level": level}
        if mode is not None:
            params["mode"] = mode
        await self.control("POST", "/sleep", params=params)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """``POST /wake_up`` (``tags``: ``weights`` and/or ``kv_cache``; None wakes both)."""
        tag_list = list(tags) if tags is not None else []
        await self.control("POST", "/wake_up", params={"tags": tag_list} if tag_list else None)

    async def is_paused(self) -> list[bool]:
        """``GET /is_paused`` of every server."""
        return self._field(
            await self.control_json("GET", "/is_paused"), "/is_paused", "is_paused", bool
        )

    async def is_sleeping(self) -> list[bool]:
        """``GET /is_sleeping`` of every server."""
        return self._field(
            await self.control_json("GET", "/is_sleeping"), "/is_sleeping", "is_sleeping", bool
        )

    async def reset_prefix_cache(self) -> None:
        """``POST /reset_prefix_cache`` on every server."""
        await self.control("POST", "/reset_prefix_cache")

    async def get_world_size(self) -> list[int]:
        """``GET /get_world_size`` of every server."""
        return self._field(
            await self.control_json("GET", "/get_world_size"), "/get_world_size", "world_size", int
        )

    async def weight_checksums(self) -> list[str]:
        """One sha256 per server over its loaded weights (``POST /weight_checker`` checksum).

        The reference server's ``checksum`` field equals
        ``engines.local.engine.state_checksum`` of the same state dict; for vLLM (which
        returns only per-parameter digests) it is a sha256 over the sorted ``name:digest``
        pairs. vLLM answers 409 while paused or asleep.
        """
        path = "/weight_checker"
        values = await self.control_json("POST", path, json={"action": "checksum"})
        out = []
        for url, value in zip(self.urls, values):
            if isinstance(value, dict) and isinstance(value.get("checksum"), str):
                out.append(value["checksum"])
            elif isinstance(value, dict) and isinstance(value.get("checksums"), dict):
                pairs = "".join(f"{k}:{v}\n" for k, v in sorted(value["checksums"].items()))
                out.append(hashlib.sha256(pairs.encode()).hexdigest())
            else:
                raise InferenceServerError(
                    url, path, 200, f"not a weight_checker answer: {value!r:.200}"
                )
        return out

    async def probe(self, required: Iterable[str] = (*DATA_PLANE_ROUTES, *PAUSE_ROUTES)) -> None:
        """Check that every server serves ``required`` routes; name the vllm flag when one is missing.

        See :func:`engines.routes.probe` (side-effect free; 404 names the ``vllm serve``
        flag, 501 means present but not implemented; ``ValueError`` for an unknown route).
        """
        await probe(self, required)
