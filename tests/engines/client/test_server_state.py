"""A debugger asks each server what it is doing and always gets an answer back in time."""

from __future__ import annotations

import httpx
import trio

from engines.client import server_states
from tests.engines.helpers import serve_app, serve_reference


async def _vllm_like(method: str, path: str, headers: dict[str, str]) -> tuple[int, object]:
    if path == "/is_paused":
        return 200, {"is_paused": True}
    if path == "/is_sleeping":
        return 200, {"is_sleeping": False}
    return 404, {"error": "no route"}


async def _never_answers(method: str, path: str, headers: dict[str, str]) -> tuple[int, object]:
    await trio.sleep_forever()
    raise AssertionError("unreachable")


async def test_the_reference_server_reports_pause_load_weights_and_its_last_control_calls(
    model_dir,
):
    async with serve_reference(model_dir) as url:
        async with httpx.AsyncClient() as http:
            (await http.post(url + "/pause", params={"mode": "keep"})).raise_for_status()
        (state,) = await server_states([url])
    assert state["url"] == url and "error" not in state
    assert state["is_paused"] is True and state["is_sleeping"] is False
    assert state["num_requests_running"] == 0 and "weight_version" in state
    assert state["last_control_calls"] == ["/pause?mode=keep"]


async def test_a_vllm_server_is_asked_its_pause_and_sleep_routes_and_a_hung_one_is_an_error():
    async with serve_app(_vllm_like) as vllm, serve_app(_never_answers) as hung:
        t0 = trio.current_time()
        states = await server_states([vllm, hung, "http://127.0.0.1:9"], timeout_s=2.0)
        elapsed = trio.current_time() - t0
    assert states[0] == {"url": vllm, "is_paused": True, "is_sleeping": False}
    assert states[1] == {"url": hung, "error": "no answer within 2s"}
    assert states[2]["url"] == "http://127.0.0.1:9" and "ConnectError" in states[2]["error"]
    assert elapsed < 30  # bounded: the hung server does not hold the others
