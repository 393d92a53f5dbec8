"""What the reference server does to requests in flight: ``/pause`` in each mode
(``keep`` freezes them, ``abort`` ends them with partial tokens, ``wait`` drains them), the
control plane answering while they hold every data connection, and a client that goes away.

Each test serves the same ``ServerApp`` in-process (``serve_reference_engine``), so it can
hold a decode step (``StepGate``): the pause lands while the requests are in flight, however
fast the engine decodes.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import trio

from engines.client import DATA_CONNECTIONS_PER_SERVER, InferenceClient
from engines.local.engine import LocalEngine
from engines.types import Completion, SamplingParams
from tests.engines.helpers import StepGate, serve_reference_engine, stats, steps

LONG = SamplingParams(max_tokens=250, ignore_eos=True, temperature=1.0)


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """One torch thread, like a server process (see ``one_torch_thread``): the in-process
    servers decode in this process."""


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
