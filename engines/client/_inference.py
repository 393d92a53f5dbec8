"""``InferenceClient``: one client for the reference servers and for real ``vllm serve``.

::

    async with InferenceClient(urls) as client:
        await client.probe()                          # fails with the vllm flag to set
        completion = await client.generate(prompt_ids, SamplingParams(max_tokens=64),
                                           trajectory_id="prompt-7/sample-2")
        samples = await client.generate_n(prompt_ids, SamplingParams(seed=5), 8)  # vLLM's n
        scores = await client.prompt_logprobs(token_ids)  # each token's logprob given those before
        await client.pause("keep")                    # every server, concurrently
        ...
        await client.resume()

Data plane (``generate``, ``generate_n`` and ``prompt_logprobs``, here): each request goes to one server (the same one for the same
``trajectory_id``, round-robin without one), at most ``max_concurrency`` in flight. Only
transport errors are retried (bounded exponential backoff); an HTTP status never is. It is
bounded by nothing but the caller's cancel scopes (the step deadline).

Control plane (``pause``, ``resume``, ``sleep``, ``wake_up``, ... or ``control``), inherited
from :class:`~engines.client.ControlPlane`: fans out to every server at once, each call
inside ``operation(path)`` and bounded by ``control_plane_timeout_s`` with a trio cancel scope
(so a server that accepts the connection and never answers is caught) ->
:class:`~trainer.errors.InferenceServerTimeoutError`. Only connection failures (the request
never reached the server) are retried there.

Errors: a non-2xx answer or a malformed body raises
:class:`~trainer.errors.InferenceServerError` (URL, endpoint, status, body excerpt); a
transport failure after its retries raises it with ``status=None``. No httpx exception
escapes. When several servers fail one fan-out, the first (in URL order) is raised with the
others attached as notes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
import trio

from engines.client._control_plane import (
    ControlPlane,
)
from engines.client._requests import (
    BODY_EXCERPT_CHARS,
    DEFAULT_RETRY,
    RETRYABLE_ERRORS,
    RetryPolicy,
    decode_json,
    send,
)
from engines.client._rotation import is_engine_failure
from engines.types import Completion, PromptLogprob, SamplingParams
from trainer.errors import InferenceServerError
from trainer.vocabulary import fire_fault, operation

__all__ = ["DATA_CONNECTIONS_PER_SERVER", "InferenceClient"]

#: Data-plane HTTP/1.1 connections per server (requests beyond it queue in the client).
DATA_CONNECTIONS_PER_SERVER = 32


class InferenceClient(ControlPlane):
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
        retry: RetryPolicy = DEFAULT_RETRY,
        connect_timeout_s: float = 10.0,
    ) -> None:
        """``control_plane_timeout_s`` is resolved by :func:`resolve_control_plane_timeout`
        (the env var wins; None means 600 s; <= 0 disables). ``model`` is sent as the
        completions ``model`` field (vLLM uses its served model when it is omitted).
        ``ValueError`` for no URLs or a non-positive ``max_concurrency``."""
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
        super().__init__(
            urls,
            api_key=api_key,
            control_plane_timeout_s=control_plane_timeout_s,
            retry=retry,
            connect_timeout_s=connect_timeout_s,
        )
        self.model = model
        self._limiter = trio.CapacityLimiter(max_concurrency)
        # Generation shares a bounded pool: httpcore scans every idle connection on each
        # request, so a pool of hundreds makes a burst quadratic (measured: 128 concurrent
        # requests took 1.0-3.7 s with an unbounded pool, 0.7-0.9 s with 16-32 connections).
        per_server = min(max_concurrency, DATA_CONNECTIONS_PER_SERVER) * len(self.urls)
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=connect_timeout_s),
            limits=httpx.Limits(max_connections=per_server, max_keepalive_connections=per_server),
        )

    async def aclose(self) -> None:
        """Close the connection pools (idempotent)."""
        await self._http.aclose()
        await super().aclose()

    # -- data plane -------------------------------------------------------------------------------

    def url_for(self, trajectory_id: str | None) -> str:
        """The server of a trajectory: stable for one id while it is live (sha256, not
        ``hash``), round-robin for None (:meth:`engines.client.Rotation.pick`)."""
        index = self.rotation.pick(trajectory_id)
        return self.rotation.urls[0 if index is None else index]

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        *,
        trajectory_id: str | None = None,
        url: str | None = None,
    ) -> Completion:
        """Sample one completion of ``prompt_ids`` (``POST /v1/completions`` with token ids).

        Runs inside ``operation("generate")``, where the ``generate`` fault fires (before the
        request); waits for a slot under the concurrency cap. Raises ``InferenceServerError``
        for a 4xx/5xx (not retried: e.g. a sleeping engine answers 409), a body that is not
        a completion, or a transport failure after retries; ``FaultInjected`` for an
        ``error`` fault. On cancellation the HTTP request is dropped (the reference server
        then aborts it). ``url``: this server, whatever its state (the weight check's probe).

        When the rotation has a failure handler (engine recovery), a server that fails the
        request (no answer, or a 5xx) is taken out and the request is sent again to another,
        waiting while none is live; so is a request whose server is taken out under it.
        """
        (completion,) = await self.generate_n(
            prompt_ids, sampling, 1, trajectory_id=trajectory_id, url=url
        )
        return completion

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
        url: str | None = None,
    ) -> list[Completion]:
        """``n`` completions of ``prompt_ids`` in one request (the completions route's ``n``).

        Sample ``i`` is seeded ``seed + i`` by the server (vLLM's parallel sampling), so this
        equals ``n`` calls of :meth:`generate`; one request, one slot under the concurrency
        cap and one fault hook. The completions come back in sample order. Errors and
        failed servers as :meth:`generate`; ``ValueError`` for ``n < 1``.
        """
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        body: dict[str, object] = {
            "prompt": list(prompt_ids),
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": sampling.seed,
            "stop_token_ids": list(sampling.stop_token_ids),
            "ignore_eos": sampling.ignore_eos,
            "logprobs": 0,
            "return_token_ids": True,
            "n": n,
        }
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        if sampling.prompt_logprobs is not None:
            body["prompt_logprobs"] = sampling.prompt_logprobs
        if self.model is not None:
            body["model"] = self.model
        with operation("generate"):
            await fire_fault("generate")
            async with self._limiter:
                if url is not None:
                    return await self._complete(url.rstrip("/"), body, prompt_ids, n)
                return await self._complete_on_a_live_server(trajectory_id, body, prompt_ids, n)

    async def prompt_logprobs(
        self, token_ids: list[int], k: int = 0, *, trajectory_id: str | None = None
    ) -> list[PromptLogprob | None]:
        """What the model makes of ``token_ids`` (vLLM's ``prompt_logprobs=k`` on the
        completions route, with one greedy token sampled, which vLLM needs): per token, None
        for the first, then its logprob given the tokens before it (raw logits), its rank and
        the ``k`` best. The caller names the operation (no ``generate`` fault fires here).
        Errors, retries and failed servers as :meth:`generate`."""
        body: dict[str, object] = {
            "prompt": list(token_ids),
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": k,
            "return_token_ids": True,
            "logprobs": 0,
        }
        if self.model is not None:
            body["model"] = self.model
        async with self._limiter:
            (completion,) = await self._complete_on_a_live_server(trajectory_id, body, token_ids, 1)
        if len(completion.prompt_logprobs) != len(token_ids):
            raise InferenceServerError(
                self.rotation.urls[0],
                "/v1/completions",
                200,
                f"{len(completion.prompt_logprobs)} prompt logprobs for {len(token_ids)} tokens",
            )
        return completion.prompt_logprobs

    async def _complete_on_a_live_server(
        self, trajectory_id: str | None, body: dict[str, object], prompt_ids: list[int], n: int
    ) -> list[Completion]:
        rotation = self.rotation
        while True:
            index = await rotation.wait_pick(trajectory_id)
            url = rotation.urls[index]
            with rotation.request(index):
                try:
                    return await self._complete(url, body, prompt_ids, n)
                except InferenceServerError as exc:
                    if rotation.on_failure is None or not is_engine_failure(exc):
                        raise
                    rotation.failed(index, str(exc))
            # the server failed or was taken out under the request: send it again

    async def _complete(
        self, url: str, body: dict[str, object], prompt_ids: list[int], n: int
    ) -> list[Completion]:
        path = "/v1/completions"
        response = await send(
            self._http,
            url,
            "POST",
            path,
            headers=self._headers,
            retry=self.retry,
            retry_on=RETRYABLE_ERRORS,
            json_body=body,
        )
        k = body.get("prompt_logprobs")
        data = decode_json(url, path, response)
        return _completions(url, path, data, prompt_ids, n, k if isinstance(k, int) else 0)


def _completions(
    url: str, path: str, data: Any, prompt_ids: list[int], n: int, prompt_k: int = 0
) -> list[Completion]:
    """The ``n`` completions of a ``/v1/completions`` answer, by choice index;
    ``InferenceServerError`` if it holds anything else."""
    try:
        # by "index" (vLLM always sends it; a choice without one keeps its place)
        indexed = sorted((int(c.get("index", i)), i, c) for i, c in enumerate(data["choices"]))
        if [index for index, _, _ in indexed] != list(range(n)):
            raise ValueError(f"choice indices {[i for i, _, _ in indexed]}, expected 0..{n - 1}")
        return [_completion(choice, prompt_ids, prompt_k) for _, _, choice in indexed]
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        excerpt = json.dumps(data)[:BODY_EXCERPT_CHARS]
        raise InferenceServerError(
            url, path, 200, f"not a completion ({exc!r}): {excerpt}"
        ) from None


def _completion(choice: Any, prompt_ids: list[int], prompt_k: int = 0) -> Completion:
    """One choice as a ``Completion`` (``prompt_k``: the ``prompt_logprobs`` asked for);
    KeyError, TypeError or ValueError when malformed."""
    token_ids = [int(t) for t in choice["token_ids"]]
    logprobs = [float(lp) for lp in choice["logprobs"]["token_logprobs"]]
    finish_reason = choice["finish_reason"]
    prompt = choice.get("prompt_token_ids") or list(prompt_ids)
    if finish_reason not in ("stop", "length", "abort") or len(logprobs) != len(token_ids):
        raise ValueError(
            f"finish_reason={finish_reason!r}, {len(logprobs)} logprobs for {len(token_ids)} tokens"
        )
    prompt = [int(t) for t in prompt]
    scored = choice.get("prompt_logprobs")
    return Completion(
        token_ids,
        logprobs,
        finish_reason,
        prompt,
        stop_reason=choice.get("stop_reason"),
        prompt_logprobs=[] if scored is None else _prompt_logprobs(scored, prompt, prompt_k),
    )


def _prompt_logprobs(scored: Any, prompt: list[int], k: int) -> list[PromptLogprob | None]:
    """A choice's ``prompt_logprobs`` (vLLM's: per prompt token None, or token id -> its
    ``logprob`` and ``rank``: the prompt token's and the ``k`` best); KeyError, TypeError or
    ValueError when malformed."""
    if len(scored) != len(prompt):
        raise ValueError(f"{len(scored)} prompt logprobs for {len(prompt)} prompt tokens")
    out: list[PromptLogprob | None] = []
    for tok, position in zip(prompt, scored):
        if position is None:
            out.append(None)
            continue
        own = position[str(tok)]
        entries = sorted((int(e["rank"]), int(t), float(e["logprob"])) for t, e in position.items())
        top = [(t, lp) for rank, t, lp in entries if rank <= k]
        out.append(PromptLogprob(float(own["logprob"]), int(own["rank"]), top))
    return out
