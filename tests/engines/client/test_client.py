"""InferenceClient against tiny real HTTP servers that misbehave on purpose."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import trio

from engines.client import (
    CONTROL_PLANE_TIMEOUT_ENV,
    PAUSE_ROUTES,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
    InferenceClient,
    RetryPolicy,
    resolve_control_plane_timeout,
)
from engines.types import SamplingParams
from tests.engines.helpers import serve_app
from trainer.errors import (
    ConfigError,
    InferenceServerError,
    InferenceServerTimeoutError,
    StepTimeoutError,
)
from trainer.vocabulary import step_deadline

COMPLETION = {
    "choices": [
        {
            "index": 0,
            "token_ids": [4, 5],
            "logprobs": {"token_logprobs": [-0.5, -1.0]},
            "finish_reason": "length",
            "prompt_token_ids": [1, 2],
        }
    ]
}


async def ok(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    return 200, COMPLETION if path == "/v1/completions" else {"is_paused": False}


async def hangs_on_pause(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    if path == "/pause":
        await trio.sleep_forever()
    return 200, {}


def free_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


async def test_control_route_that_never_answers_raises_a_picklable_timeout_error() -> None:
    async with (
        serve_app(hangs_on_pause) as url,
        InferenceClient([url], control_plane_timeout_s=0.5) as client,
    ):
        with pytest.raises(InferenceServerTimeoutError) as info:
            await client.pause("keep")
    err = info.value
    assert (err.url, err.endpoint, err.timeout_s) == (url, "/pause", 0.5)
    assert "TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert type(clone) is InferenceServerTimeoutError
    assert (clone.url, clone.endpoint, clone.timeout_s, str(clone)) == (
        err.url,
        err.endpoint,
        err.timeout_s,
        str(err),
    )


async def test_without_a_control_plane_timeout_the_step_deadline_names_the_operation() -> None:
    async with (
        serve_app(hangs_on_pause) as url,
        InferenceClient([url], control_plane_timeout_s=0) as client,
    ):
        assert client.control_plane_timeout_s is None
        with pytest.raises(StepTimeoutError) as info, step_deadline(4, 0.5):
            await client.pause("keep")
    assert info.value.step == 4
    assert info.value.operation == "/pause"


def test_control_plane_timeout_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CONTROL_PLANE_TIMEOUT_ENV, raising=False)
    assert resolve_control_plane_timeout(None) == 600.0
    assert resolve_control_plane_timeout(30) == 30.0
    assert resolve_control_plane_timeout(0) is None
    assert resolve_control_plane_timeout(-1) is None
    monkeypatch.setenv(CONTROL_PLANE_TIMEOUT_ENV, "2.5")
    assert resolve_control_plane_timeout(None) == 2.5  # unset: the environment's
    # given (the trainer gives the run plan's, the environment applied once at load): as given
    assert resolve_control_plane_timeout(30) == 30.0
    assert InferenceClient(["http://x"], control_plane_timeout_s=30).control_plane_timeout_s == 30
    assert InferenceClient(["http://x"]).control_plane_timeout_s == 2.5
    monkeypatch.setenv(CONTROL_PLANE_TIMEOUT_ENV, "0")
    assert resolve_control_plane_timeout(None) is None
    monkeypatch.setenv(CONTROL_PLANE_TIMEOUT_ENV, "soon")
    with pytest.raises(ConfigError, match=CONTROL_PLANE_TIMEOUT_ENV):
        resolve_control_plane_timeout(None)


async def plain_server(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
    """A server without dev-mode routes: only /health and /v1/completions exist."""
    if path == "/health":
        return 200, b""
    if path == "/v1/completions":
        return (405, {"detail": "Method Not Allowed"}) if method == "GET" else (200, COMPLETION)
    if path == "/init_weight_transfer_engine":
        return 501, {"error": {"message": "not yet", "type": "NotImplementedError", "code": 501}}
    return 404, {"detail": "Not Found"}


@pytest.mark.parametrize(
    ("routes", "flag"),
    [
        (PAUSE_ROUTES, "VLLM_SERVER_DEV_MODE=1"),
        (SLEEP_ROUTES, "--enable-sleep-mode"),
        (WEIGHT_TRANSFER_ROUTES[1:], "--weight-transfer-config"),
    ],
)
async def test_probe_names_the_vllm_flag_of_a_missing_route(
    routes: tuple[str, ...], flag: str
) -> None:
    async with serve_app(plain_server) as url, InferenceClient([url]) as client:
        await client.probe(["/health", "/v1/completions"])
        with pytest.raises(InferenceServerError) as info:
            await client.probe(routes)
    assert info.value.status == 404
    assert info.value.url == url
    assert flag in str(info.value)


async def test_probe_tells_an_unimplemented_route_from_a_missing_one() -> None:
    async with serve_app(plain_server) as url, InferenceClient([url]) as client:
        with pytest.raises(InferenceServerError) as info:
            await client.probe(["/init_weight_transfer_engine"])
    assert info.value.status == 501
    assert "does not implement" in str(info.value)


async def test_non_2xx_and_malformed_bodies_raise_inference_server_error() -> None:
    async def broken(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        if path == "/resume":
            return 500, {"error": {"message": "kaboom", "type": "InternalServerError", "code": 500}}
        if path == "/is_paused":
            return 200, b"<html>not json"
        return 200, {"choices": []}

    async with serve_app(broken) as url, InferenceClient([url]) as client:
        with pytest.raises(InferenceServerError) as info:
            await client.resume()
        assert (info.value.url, info.value.endpoint, info.value.status) == (url, "/resume", 500)
        assert info.value.detail == "kaboom"
        with pytest.raises(InferenceServerError, match="malformed JSON"):
            await client.is_paused()
        with pytest.raises(InferenceServerError, match="not a completion") as info:
            await client.generate([1, 2], SamplingParams())
        assert info.value.endpoint == "/v1/completions"


async def test_a_control_call_answers_the_routes_json_body() -> None:
    """The body decoded (None when empty), as the in-process vLLM engine answers; the probe
    still finds a route whose answer is not JSON (a /health that says ``OK``)."""

    async def answers(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        if path == "/health":
            return 200, b"OK"
        if path == "/resume":
            return 200, b""
        return 200, {"is_paused": True}

    async with serve_app(answers) as url, InferenceClient([url]) as client:
        assert await client.control("GET", "/is_paused") == [{"is_paused": True}]
        assert await client.control_one(url, "POST", "/resume") is None
        with pytest.raises(InferenceServerError, match="malformed JSON") as info:
            await client.control_one(url, "GET", "/health")
        assert (info.value.endpoint, info.value.status) == ("/health", 200)
        await client.probe(["/health"])


async def test_http_errors_are_never_retried() -> None:
    calls: list[str] = []

    async def unavailable(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        calls.append(path)
        return 503, {"error": {"message": "busy", "type": "ServiceUnavailable", "code": 503}}

    async with (
        serve_app(unavailable) as url,
        InferenceClient([url], retry=RetryPolicy(backoff_s=0.01)) as client,
    ):
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1], SamplingParams())
    assert info.value.status == 503
    assert calls == ["/v1/completions"]


async def test_transport_errors_are_retried_then_name_the_server() -> None:
    url = free_port_url()  # nothing listens there
    async with InferenceClient([url], retry=RetryPolicy(max_retries=2, backoff_s=0.01)) as client:
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1], SamplingParams())
    assert info.value.status is None
    assert info.value.url == url
    assert "after 3 attempts" in str(info.value)
    assert url in str(info.value)


async def test_control_calls_retry_failed_connections_by_the_clients_one_policy() -> None:
    url = free_port_url()  # nothing listens there
    async with InferenceClient([url], retry=RetryPolicy(max_retries=1, backoff_s=0.0)) as client:
        with pytest.raises(InferenceServerError, match="after 2 attempts") as info:
            await client.pause()
    assert info.value.endpoint == "/pause" and info.value.status is None


@pytest.mark.parametrize("bad", [{"max_retries": -1}, {"backoff_s": -0.1}, {"max_backoff_s": -1}])
def test_a_retry_policy_refuses_a_negative_count_or_wait(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        RetryPolicy(**bad)  # type: ignore[arg-type]


async def test_a_fan_out_with_several_failures_raises_the_first_with_the_others_as_notes() -> None:
    async def fails(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        return 500, {"error": {"message": "down", "type": "InternalServerError", "code": 500}}

    async with (
        serve_app(ok) as good,
        serve_app(fails) as bad1,
        serve_app(fails) as bad2,
        InferenceClient([good, bad1, bad2]) as client,
    ):
        with pytest.raises(InferenceServerError) as info:
            await client.resume()
    assert not isinstance(info.value, BaseExceptionGroup)
    assert info.value.url == bad1
    assert any(bad2 in note for note in info.value.__notes__)


async def test_requests_of_one_trajectory_stick_to_one_server() -> None:
    client = InferenceClient([f"http://s{i}" for i in range(4)])
    assert {client.url_for("traj-7") for _ in range(10)} == {client.url_for("traj-7")}
    assert {client.url_for(f"traj-{i}") for i in range(64)} == set(client.urls)
    await client.aclose()


async def test_the_step_header_is_sent_inside_a_step_only() -> None:
    seen: list[str | None] = []

    async def record(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        seen.append(headers.get("x-trainer-step"))
        return 200, {}

    async with serve_app(record) as url, InferenceClient([url]) as client:
        await client.resume()
        with step_deadline(7, None):
            await client.resume()
    assert seen == [None, "7"]


async def test_concurrency_cap_bounds_requests_in_flight() -> None:
    in_flight = 0
    peak = 0

    full = trio.Event()

    async def slow(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        if in_flight == 3:
            full.set()
        with trio.move_on_after(30):  # hold the first requests until the cap is reached
            await full.wait()
        in_flight -= 1
        return 200, COMPLETION

    async with (
        serve_app(slow) as url,
        InferenceClient([url], max_concurrency=3) as client,
        trio.open_nursery() as nursery,
    ):
        for _ in range(10):
            nursery.start_soon(client.generate, [1, 2], SamplingParams())
    assert peak == 3


async def test_n_completions_come_back_by_index_and_a_missing_one_is_an_error() -> None:
    first, second = (dict(COMPLETION["choices"][0], index=i, token_ids=[4 + i, 5]) for i in (0, 1))

    async def answer(method: str, path: str, headers: dict[str, str]) -> tuple[int, Any]:
        return 200, {"choices": [second, first]}  # children as they finished

    async with serve_app(answer) as url, InferenceClient([url]) as client:
        both = await client.generate_n([1, 2], SamplingParams(seed=3), 2)
        assert [c.token_ids for c in both] == [[4, 5], [5, 5]]
        with pytest.raises(InferenceServerError, match="choice indices"):
            await client.generate_n([1, 2], SamplingParams(seed=3), 3)
        with pytest.raises(ValueError, match="n must be at least 1"):
            await client.generate_n([1, 2], SamplingParams(), 0)
