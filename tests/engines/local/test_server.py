"""The reference server over real HTTP, in a real process started by ``engines.launch``.

One server serves the whole module (``engine_urls``); tests leave it resumed and awake with
the weights it started with, so they pass in any order. A test that needs a server in a
state of its own (weights discarded, no weight-transfer routes), or that must hold a decode
step to pause or cancel requests in flight (``StepGate``), serves the same ``ServerApp``
in-process (``serve_reference``, ``serve_reference_engine``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.client import DATA_CONNECTIONS_PER_SERVER, WEIGHT_TRANSFER_ROUTES, InferenceClient
from engines.local.engine import LocalEngine
from engines.models import load_tokenizer
from engines.types import Completion, SamplingParams
from tests.engines.helpers import (
    StepGate,
    serve_reference,
    serve_reference_engine,
    stats,
    steps,
)
from trainer.errors import FaultInjected, InferenceServerError
from trainer.vocabulary import install_faults, step_deadline

LONG = SamplingParams(max_tokens=250, ignore_eos=True, temperature=1.0)


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """One torch thread, like the module's server process (see ``one_torch_thread``): the
    in-process servers decode in this process."""


@pytest.fixture(autouse=True)
async def _leave_the_server_serving(engine_urls: list[str]) -> AsyncIterator[None]:
    """Whatever a test did (or failed to undo), the next one finds the server resumed and awake."""
    yield
    async with httpx.AsyncClient(timeout=30) as http:
        await http.post(f"{engine_urls[0]}/resume")
        await http.post(f"{engine_urls[0]}/wake_up")


async def test_32_concurrent_requests_complete_and_are_batched(engine_urls: list[str]) -> None:
    url = engine_urls[0]
    before = (await stats(url))["batch_size_counts"]
    results: list[Completion | None] = [None] * 32
    async with InferenceClient(engine_urls) as client:

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=24, ignore_eos=True, seed=i)
            results[i] = await client.generate([5 + i % 10, 6, 7], params, trajectory_id=f"t{i}")

        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(one, i)
    for c in results:
        assert c is not None
        assert c.finish_reason == "length"
        assert len(c.token_ids) == len(c.logprobs) == 24
        assert all(lp <= 0 for lp in c.logprobs)
    after = (await stats(url))["batch_size_counts"]
    new_steps = {int(k): v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    assert max(new_steps) > 1, f"no batching: {new_steps}"


async def test_completion_response_follows_vllm_shape(engine_urls: list[str], model_dir) -> None:
    body = {
        "prompt": "1 + 2 =",
        "n": 2,
        "seed": 7,
        "max_tokens": 5,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient() as http:
        data = (await http.post(f"{engine_urls[0]}/v1/completions", json=body)).json()
    assert data["object"] == "text_completion"
    prompt_ids = load_tokenizer(model_dir).encode("1 + 2 =")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(choice["token_ids"]) == 5
        assert len(choice["logprobs"]["token_logprobs"]) == 5
        assert len(choice["logprobs"]["tokens"]) == 5
        assert choice["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": 2 * len(prompt_ids),
        "completion_tokens": 10,
        "total_tokens": 2 * len(prompt_ids) + 10,
    }


async def test_same_seed_gives_the_same_tokens(engine_urls: list[str]) -> None:
    async with InferenceClient(engine_urls) as client:
        params = SamplingParams(max_tokens=12, ignore_eos=True, seed=1234)
        a = await client.generate([3, 4, 5], params)
        b = await client.generate([3, 4, 5], params)
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs)


async def test_n_samples_in_one_request_equal_n_requests_seeded_one_apart(
    engine_urls: list[str],
) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=500)
    async with InferenceClient(engine_urls) as client:
        before = steps(await stats(engine_urls[0]))
        together = await client.generate_n([3, 4, 5], params, 4)
        shared_steps = steps(await stats(engine_urls[0])) - before
        apart = [
            await client.generate([3, 4, 5], attrs.evolve(params, seed=500 + i)) for i in range(4)
        ]
    assert [c.token_ids for c in together] == [c.token_ids for c in apart]
    for a, b in zip(together, apart):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.prompt_token_ids == [3, 4, 5]
    assert len({tuple(c.token_ids) for c in together}) > 1  # four different samples
    assert shared_steps == 6  # the four decoded together: one step per token


async def test_a_generate_fault_fires_in_the_client_before_the_request(
    engine_urls: list[str],
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=3)
    async with InferenceClient(engine_urls) as client:
        assert len((await client.generate([3, 4, 5], params)).token_ids) == 4  # no fault: works
        before = steps(await stats(engine_urls[0]))
        install_faults("generate:error=boom")
        try:
            with pytest.raises(FaultInjected) as info, step_deadline(5, None):
                await client.generate([3, 4, 5], params)
        finally:
            install_faults("")
        assert steps(await stats(engine_urls[0])) == before  # nothing reached the server
        assert len((await client.generate([3, 4, 5], params)).token_ids) == 4
    assert (info.value.operation, info.value.message, info.value.step) == ("generate", "boom", 5)


async def test_info_routes(engine_urls: list[str]) -> None:
    url = engine_urls[0]
    async with httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/health")).status_code == 200
        models = (await http.get(f"{url}/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["object"] == "model"
        metrics = (await http.get(f"{url}/metrics")).text
        assert "engine_decode_steps_total" in metrics
    async with InferenceClient(engine_urls) as client:
        assert await client.get_world_size() == [1]
        await client.reset_prefix_cache()
        await client.probe([*client_routes()])


def client_routes() -> tuple[str, ...]:
    from engines.client import DATA_PLANE_ROUTES, PAUSE_ROUTES, SLEEP_ROUTES

    return (*DATA_PLANE_ROUTES, *PAUSE_ROUTES, *SLEEP_ROUTES, "/reset_prefix_cache")


# The pause tests serve the same ServerApp in-process (``serve_reference_engine``), so they can
# hold a decode step (``StepGate``): the pause lands while the requests are in flight,
# however fast the engine decodes.


def _all_running(engine: LocalEngine, n: int) -> Callable[[], bool]:
    return lambda: engine.num_running == n


async def test_pause_keep_freezes_in_flight_requests_until_resume(model_dir) -> None:
    results: list[Completion] = []
    async with serve_reference_engine(model_dir) as (url, engine):
        all_in = _all_running(engine, 4)
        async with InferenceClient([url]) as client, trio.open_nursery() as nursery:
            with StepGate(engine, hold={all_in}) as gate:
                for i in range(4):
                    nursery.start_soon(lambda i=i: _collect(client, results, [7, i + 1], LONG))
                await gate.pause_at(all_in, partial(client.pause, "keep"))
            assert await client.is_paused() == [True]
            frozen = await stats(url)
            await trio.sleep(0.5)
            still = await stats(url)
            assert steps(still) == steps(frozen), "decoded while paused (keep)"
            assert still["num_requests_running"] == 4
            assert results == []
            await client.resume()
    assert [c.finish_reason for c in results] == ["length"] * 4
    assert all(len(c.token_ids) == 250 for c in results)


async def test_control_plane_answers_while_frozen_requests_hold_every_data_connection(
    model_dir,
) -> None:
    n = DATA_CONNECTIONS_PER_SERVER + 8  # more frozen requests than the data-plane pool holds
    results: list[Completion] = []
    async with serve_reference_engine(model_dir) as (url, engine):
        pool_full = _all_running(engine, DATA_CONNECTIONS_PER_SERVER)
        async with InferenceClient([url]) as client, trio.open_nursery() as nursery:
            with StepGate(engine, hold={pool_full}) as gate:
                for i in range(n):
                    nursery.start_soon(lambda i=i: _collect(client, results, [7, i % 40 + 1], LONG))
                await gate.pause_at(pool_full, partial(client.pause, "keep"))
            assert (await stats(url))["num_requests_running"] == DATA_CONNECTIONS_PER_SERVER
            with trio.fail_after(30):  # a control call must not queue behind frozen generation
                assert await client.is_paused() == [True]
                await client.resume()
    assert len(results) == n


async def test_pause_abort_ends_in_flight_requests_with_partial_tokens(model_dir) -> None:
    results: list[Completion] = []
    async with serve_reference_engine(model_dir) as (url, engine), InferenceClient([url]) as client:
        all_in = _all_running(engine, 4)
        async with trio.open_nursery() as nursery:
            with StepGate(engine, hold={all_in}) as gate:
                for i in range(4):
                    nursery.start_soon(lambda i=i: _collect(client, results, [8, i + 1], LONG))
                await gate.pause_at(all_in, partial(client.pause, "abort"))
        assert [c.finish_reason for c in results] == ["abort"] * 4
        assert all(0 < len(c.token_ids) < 250 for c in results)
        assert all(len(c.logprobs) == len(c.token_ids) for c in results)
        assert await client.is_paused() == [True]
        await client.resume()
        assert await client.is_paused() == [False]


async def test_pause_wait_drains_in_flight_requests_then_pauses(model_dir) -> None:
    events: list[str] = []
    results: list[Completion] = []
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    async with serve_reference_engine(model_dir) as (url, engine), InferenceClient([url]) as client:
        all_in = _all_running(engine, 4)
        async with trio.open_nursery() as nursery:
            with StepGate(engine, hold={all_in}) as gate:
                for i in range(4):

                    async def one(i: int = i) -> None:
                        await _collect(client, results, [9, i + 1], params)
                        events.append("done")

                    nursery.start_soon(one)
                await gate.reached(all_in)
                assert results == []  # all four in flight when the drain starts
                await gate.pause_at(all_in, partial(client.pause, "wait"))
            drained = await stats(url)  # the 4 responses may still be on their way
        assert (drained["num_requests_running"], drained["num_requests_waiting"]) == (0, 0)
        assert [(c.finish_reason, len(c.token_ids)) for c in results] == [("length", 60)] * 4
        assert events == ["done"] * 4
        assert steps(await stats(url)) == steps(drained)  # paused: nothing decodes
        # a request sent while paused waits for the resume
        late: list[Completion] = []
        answered = trio.Event()

        async def late_request() -> None:
            await _collect(client, late, [1, 2], SamplingParams(max_tokens=3))
            answered.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(late_request)
            with trio.move_on_after(1.0):
                await answered.wait()
            assert late == []
            await client.resume()
        assert len(late) == 1 and late[0].finish_reason in ("length", "stop")


async def _collect(
    client: InferenceClient, out: list[Completion], prompt: list[int], params: SamplingParams
) -> None:
    out.append(await client.generate(prompt, params))


async def test_a_client_that_goes_away_takes_its_request_out_of_the_batch(model_dir) -> None:
    async with serve_reference_engine(model_dir) as (url, engine), InferenceClient([url]) as client:
        with StepGate(engine, hold={2}) as gate:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(client.generate, [4, 4], LONG)
                await gate.reached(2)  # in flight, its second step held
                nursery.cancel_scope.cancel()  # e.g. a step deadline
            with trio.fail_after(30):  # the server sees the client go away
                while engine.num_requests:  # noqa: ASYNC110 - no event for it
                    await trio.sleep(0.01)
            gate.release(2)
        assert steps(await stats(url)) == 2  # out of the batch while its second step ran


BAD_REQUESTS = [
    pytest.param("POST", "/v1/completions", b"{bad", id="malformed-json"),
    pytest.param("POST", "/v1/completions", b"[1, 2]", id="not-an-object"),
    pytest.param("POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', id="nan"),
    pytest.param("POST", "/v1/completions", {"max_tokens": 4}, id="no-prompt"),
    pytest.param("POST", "/v1/completions", {"prompt": 5}, id="prompt-wrong-type"),
    pytest.param("POST", "/v1/completions", {"prompt": [1, "a"]}, id="token-wrong-type"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1], "max_tokens": "8"}, id="max-tokens-string"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "ignore_eos": 1}, id="bool-wrong-type"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, id="negative-max-tokens"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1, 10**6]}, id="out-of-vocab"),
    pytest.param("POST", "/v1/completions", {"prompt": [-1]}, id="negative-token-id"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1] * 250, "max_tokens": 100}, id="too-long"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "top_p": 0}, id="top-p-zero"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "echo": True}, id="echo-unsupported"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "logprobs": 21}, id="logprobs-over-20"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "stop": [3]}, id="stop-not-strings"),
    pytest.param("POST", "/v1/chat/completions", {"max_tokens": 4}, id="chat-no-messages"),
    pytest.param(
        "POST", "/v1/chat/completions", {"messages": [{"content": "a"}]}, id="chat-no-role"
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        id="chat-image-part",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        id="chat-top-logprobs-without-logprobs",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        id="chat-auto-tool-choice",
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "model": "nope"}, id="unknown-model"),
    pytest.param("POST", "/pause?mode=later", None, id="unknown-pause-mode"),
    pytest.param("POST", "/sleep?level=3", None, id="unknown-sleep-level"),
    pytest.param("POST", "/wake_up?tags=gpu", None, id="unknown-wake-tag"),
    pytest.param("POST", "/weight_checker", {"action": "explode"}, id="unknown-weight-action"),
    pytest.param("GET", "/v1/completions", None, id="wrong-method"),
    pytest.param("GET", "/no/such/route", None, id="unknown-route"),
]


@pytest.mark.parametrize(("method", "path", "body"), BAD_REQUESTS)
async def test_each_bad_input_class_gets_a_4xx_with_an_error_body(
    engine_urls: list[str], method: str, path: str, body: Any
) -> None:
    content = (
        body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    )
    async with httpx.AsyncClient() as http:
        response = await http.request(method, engine_urls[0] + path, content=content)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == response.status_code


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 100), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(JUNK, st.lists(st.integers(-3, 70), max_size=6), st.text(max_size=12)),
        "max_tokens": st.one_of(JUNK, st.integers(-3, 6)),
        "n": st.one_of(JUNK, st.integers(-2, 3)),
        "temperature": JUNK,
        "top_p": JUNK,
        "seed": JUNK,
        "stop_token_ids": JUNK,
        "ignore_eos": JUNK,
        "logprobs": st.one_of(JUNK, st.integers(-1, 2)),
        "return_token_ids": JUNK,
        "model": JUNK,
        "stream": JUNK,
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(REQUEST, st.binary(max_size=20)))
async def test_no_request_body_yields_a_5xx(engine_urls: list[str], body: Any) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=60) as http:
        response = await http.post(f"{engine_urls[0]}/v1/completions", content=content)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["error"]["code"] == response.status_code


async def test_sleep_and_wake_up_follow_vllms_state_machine(model_dir) -> None:
    params = SamplingParams(max_tokens=4)
    # a server of its own: sleeping at level 2 discards the weights the shared one must keep
    async with (
        serve_reference(model_dir, sleep_mode=True) as url,
        InferenceClient([url]) as client,
        httpx.AsyncClient() as http,
    ):
        before = await client.weight_checksums()
        await client.sleep(1)
        assert await client.is_sleeping() == [True]
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1, 2], params)
        assert info.value.status == 409 and "wake_up" in info.value.detail
        with pytest.raises(InferenceServerError) as info:
            await client.weight_checksums()
        assert info.value.status == 409

        await client.wake_up(["weights"])
        state = (await http.get(f"{url}/is_sleeping")).json()
        assert state == {"is_sleeping": True, "sleep_state": {"weights": False, "kv_cache": True}}
        with pytest.raises(InferenceServerError):
            await client.generate([1, 2], params)

        await client.wake_up(["kv_cache"])
        assert await client.is_sleeping() == [False]
        assert (await client.generate([1, 2], params)).token_ids
        assert await client.weight_checksums() == before  # level 1 kept the weights

        await client.sleep(2)
        await client.wake_up()
        assert await client.is_sleeping() == [False]
        assert await client.weight_checksums() != before  # level 2 discarded them


async def test_probe_names_the_vllm_flag_when_the_weight_transfer_routes_are_off(
    model_dir,
) -> None:
    async with (
        serve_reference(model_dir, weight_transfer_routes=False) as url,
        InferenceClient([url]) as client,
    ):
        await client.probe([*client_routes()])  # everything else is served
        with pytest.raises(InferenceServerError) as info:
            await client.probe(WEIGHT_TRANSFER_ROUTES)
        with pytest.raises(InferenceServerError) as posted:  # not only the probe's GET
            await client.control("POST", "/init_weight_transfer_engine", json={})
        async with httpx.AsyncClient() as http:
            log = (await http.get(f"{url}/control_log")).json()
    assert log == {"calls": [], "total": 0}  # probes' GETs and unserved routes are not calls
    assert info.value.status == 404
    assert info.value.url == url
    assert "--weight-transfer-config" in str(info.value)
    assert all(route in str(info.value) for route in WEIGHT_TRANSFER_ROUTES)
    assert posted.value.status == 404


async def test_without_sleep_mode_sleep_and_wake_up_are_refused_saying_how(model_dir) -> None:
    """``serve`` without ``--enable-sleep-mode``: 400 naming the flag; the engine serves on."""
    async with serve_reference(model_dir) as url, httpx.AsyncClient(timeout=60) as http:
        for path in ("/sleep?level=1", "/wake_up"):
            r = await http.post(f"{url}{path}")
            assert r.status_code == 400 and "--enable-sleep-mode" in r.text
        assert (await http.get(f"{url}/is_sleeping")).json()["is_sleeping"] is False
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
