"""The reference server's control plane (vLLM's dev-mode routes): pause, sleep, and their queries.

``POST /pause?mode=keep|abort|wait``, ``POST /resume``, ``GET /is_paused``,
``POST /sleep?level=1|2``, ``POST /wake_up[?tags=...]``, ``GET /is_sleeping``,
``POST /reset_prefix_cache``, ``GET /get_world_size`` and ``POST /weight_checker``, each a
function of the engine and the request, answering vLLM 0.33.0's shapes. The weight-transfer
routes are :mod:`engines.local.weight_routes`; the app that routes to both is
:class:`engines.local.server.ServerApp`. Bad input is a ``ProtocolError`` (a 4xx).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import torch
import trio

from engines.local.engine import LocalEngine
from engines.local.http import Request, Response, json_response
from engines.local.protocol import ProtocolError, parse_bool, parse_json_object

__all__ = ["CONTROL_ROUTES", "ControlHandler"]

#: One control route: the engine and the request in, the answer out.
ControlHandler = Callable[[LocalEngine, Request], Awaitable[Response]]


async def pause(engine: LocalEngine, request: Request) -> Response:
    # vLLM 0.33.0 declares only mode and clear_cache (its older wait_for_inflight_requests
    # is gone: vLLM ignores it, so it must not change the mode here either)
    mode = request.arg("mode") or "abort"
    if mode not in ("keep", "abort", "wait"):
        raise ProtocolError(
            400, f"unknown pause mode {mode!r}; expected keep, abort or wait", "mode"
        )
    parse_bool(request.arg("clear_cache"), "clear_cache", True)  # validated; no cache to clear
    await engine.pause(mode)  # type: ignore[arg-type]
    return json_response({"status": "paused"})


async def resume(engine: LocalEngine, request: Request) -> Response:
    engine.resume()
    return json_response({"status": "resumed"})


async def is_paused(engine: LocalEngine, request: Request) -> Response:
    return json_response({"is_paused": engine.is_paused})


async def sleep(engine: LocalEngine, request: Request) -> Response:
    raw = request.arg("level") or "1"
    if raw not in ("1", "2"):
        raise ProtocolError(400, f"sleep level must be 1 or 2, got {raw!r}", "level")
    mode = request.arg("mode") or "abort"
    if mode not in ("keep", "abort", "wait"):
        raise ProtocolError(
            400, f"unknown sleep mode {mode!r}; expected keep, abort or wait", "mode"
        )
    await engine.sleep(int(raw), mode)  # type: ignore[arg-type]
    return json_response({"status": "sleeping", "level": int(raw)})


async def wake_up(engine: LocalEngine, request: Request) -> Response:
    tags = request.query.get("tags") or None
    unknown = sorted(set(tags or ()) - {"weights", "kv_cache"})
    if unknown:
        raise ProtocolError(
            400, f"unknown wake_up tags {unknown}; expected weights, kv_cache", "tags"
        )
    await engine.wake_up(tags)
    # vLLM's answer: whether every half is awake now, and the tags it was given
    awake = not engine.is_sleeping
    return json_response({"status": "awake" if awake else "sleeping", "tags": tags})


async def is_sleeping(engine: LocalEngine, request: Request) -> Response:
    return json_response({"is_sleeping": engine.is_sleeping, "sleep_state": engine.sleep_state})


async def reset_prefix_cache(engine: LocalEngine, request: Request) -> Response:
    for name in ("reset_running_requests", "reset_external"):
        parse_bool(request.arg(name), name, False)
    return json_response({"success": True})  # no prefix cache to reset: trivially done


async def get_world_size(engine: LocalEngine, request: Request) -> Response:
    parse_bool(request.arg("include_dp"), "include_dp", True)
    return json_response({"world_size": 1})


async def weight_checker(engine: LocalEngine, request: Request) -> Response:
    body = parse_json_object(request.body)
    action = body.get("action")
    if action not in ("checksum", "compare", "reset"):
        raise ProtocolError(
            400, f"action must be one of checksum|reset|compare, got {action!r}", "action"
        )
    if engine.is_sleeping:  # vLLM on the CPU cannot sleep; the reference's weights are away
        raise ProtocolError(409, "weight_checker requires an awake engine")
    if action == "reset":  # vLLM's: every weight zeroed
        shapes = {n: (p.shape, p.dtype) for n, p in engine.model.named_parameters()}
        state = await trio.to_thread.run_sync(
            lambda: {n: torch.zeros(s, dtype=d) for n, (s, d) in shapes.items()}
        )
        await engine.load_weights(state)
        return json_response({"status": "reset"})
    baseline = body.get("baseline")
    if action == "compare" and not (
        isinstance(baseline, dict) and all(isinstance(v, str) for v in baseline.values())
    ):
        raise ProtocolError(400, "action='compare' requires a 'baseline' object", "baseline")
    checksums, combined = await trio.to_thread.run_sync(
        lambda: (engine.weight_checksums(), engine.weight_checksum())
    )
    if action == "checksum":
        return json_response(
            {
                "checksums": checksums,
                "checksum": combined,
                "weight_version": engine.weight_version,
            }
        )
    assert isinstance(baseline, dict)
    mismatches = sorted(
        n for n in set(baseline) | set(checksums) if baseline.get(n) != checksums.get(n)
    )
    return json_response({"match": not mismatches, "mismatches": mismatches})


CONTROL_ROUTES: dict[str, dict[str, ControlHandler]] = {
    "/pause": {"POST": pause},
    "/resume": {"POST": resume},
    "/is_paused": {"GET": is_paused},
    "/sleep": {"POST": sleep},
    "/wake_up": {"POST": wake_up},
    "/is_sleeping": {"GET": is_sleeping},
    "/reset_prefix_cache": {"POST": reset_prefix_cache},
    "/get_world_size": {"GET": get_world_size},
    "/weight_checker": {"POST": weight_checker},
}
