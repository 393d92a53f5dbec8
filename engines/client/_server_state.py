"""What each inference server says about itself, for a debugger: paused, sleeping, busy.

::

    states = await server_states(["http://127.0.0.1:8000"], timeout_s=2.0)
    # [{"url": "http://127.0.0.1:8000", "is_paused": False, "is_sleeping": False,
    #   "num_requests_running": 3, "num_requests_waiting": 0, "weight_version": 7}]

The reference server answers ``GET /engine_stats`` with all of it, and ``GET /control_log``
with the control-plane calls it received (the newest :data:`LAST_CONTROL_CALLS` are kept:
a ``/pause`` that never answered is there); a ``vllm serve`` in dev mode answers
``GET /is_paused`` and ``GET /is_sleeping``. Every server is asked at once through an
HTTP client of its own (never the trainer's pools, which a hung run may have exhausted), each
bounded by ``timeout_s``; a server that does not answer in time, or answers with an error,
gets an ``"error"`` entry instead of raising. No operation is named and no fault fires: the
debugger must not change what it looks at.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import trio

__all__ = ["LAST_CONTROL_CALLS", "server_states"]

#: Control-plane calls a reference server reports (its newest), e.g. a ``/pause`` that hangs.
LAST_CONTROL_CALLS = 3


async def _get_json(http: httpx.AsyncClient, url: str, path: str) -> dict[str, Any] | None:
    """The JSON object at ``url + path``; None for a 404 (a route this server lacks)."""
    response = await http.get(url + path)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    body = response.json()
    if not isinstance(body, dict):
        raise ValueError(f"{path} answered {type(body).__name__}, not an object")
    return body


async def _state_of(http: httpx.AsyncClient, url: str) -> dict[str, Any]:
    stats = await _get_json(http, url, "/engine_stats")
    if stats is not None:
        stats.pop("batch_size_counts", None)  # a histogram: for benchmarks, not for a dump
        calls = await _get_json(http, url, "/control_log")
        if calls is not None:
            stats["last_control_calls"] = calls.get("calls", [])[-LAST_CONTROL_CALLS:]
        return stats
    state: dict[str, Any] = {}
    for path in ("/is_paused", "/is_sleeping"):
        body = await _get_json(http, url, path)
        if body is not None:
            state |= body
    return state


async def server_states(
    urls: Sequence[str], *, api_key: str | None = None, timeout_s: float = 2.0
) -> list[dict[str, Any]]:
    """One dict per URL, in order: ``{"url": ..., **state}`` or ``{"url": ..., "error": ...}``.

    Returns within about ``timeout_s`` whatever the servers do. Cancellation propagates
    (the connections are closed).
    """
    results: list[dict[str, Any]] = [{"url": u} for u in urls]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(i: int, http: httpx.AsyncClient) -> None:
        url = urls[i].rstrip("/")
        with trio.move_on_after(timeout_s) as scope:
            try:
                results[i] |= await _state_of(http, url)
            except (httpx.HTTPError, ValueError) as exc:
                results[i]["error"] = f"{type(exc).__name__}: {exc}"
        if scope.cancelled_caught:
            results[i]["error"] = f"no answer within {timeout_s:g}s"

    async with httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(None)) as http:
        async with trio.open_nursery() as nursery:
            for i in range(len(urls)):
                nursery.start_soon(one, i, http)
    return results
