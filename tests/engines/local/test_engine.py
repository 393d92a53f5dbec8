"""The reference engine's state machine in-process, and its server app's auth and fault hook."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path

import httpx
import pytest
import torch
import trio
import trio.testing
from hypercorn.config import Config
from hypercorn.trio import serve

from engines.client import InferenceClient
from engines.local.engine import LocalEngine, open_local_engine
from engines.local.inprocess import open_inprocess_client
from engines.local.requests import EngineAsleepError
from engines.local.server import ServerApp
from engines.types import SamplingParams
from tests.engines.helpers import StepGate, greedy_reference
from trainer.errors import FaultInjected, InferenceServerError, StepTimeoutError
from trainer.vocabulary import install_faults, step_deadline


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """Every test here runs with one torch thread (see ``one_torch_thread``)."""


@asynccontextmanager
async def serving(engine: LocalEngine, api_key: str | None = None) -> AsyncIterator[str]:
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 0.1
    shutdown = trio.Event()
    app = ServerApp(engine, served_model="tiny", api_key=api_key)
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            shutdown.set()


async def test_a_request_to_a_paused_sleeping_engine_waits_for_wake_and_resume(
    model_dir: Path,
) -> None:
    """The fully-async offload bracket (pause, sleep, wake, resume): a rollout's request that
    arrives in the middle waits, as on vLLM's pause, instead of failing on the sleep."""
    async with open_local_engine(model_dir) as engine:
        await engine.pause("abort")
        await engine.sleep(1)
        got: list[int] = []
        async with trio.open_nursery() as nursery:

            async def request() -> None:
                got.append(
                    len((await engine.generate([1, 2], SamplingParams(max_tokens=3))).token_ids)
                )

            nursery.start_soon(request)
            await trio.testing.wait_all_tasks_blocked()  # it went as far as it can
            assert got == [] and engine.num_waiting == 1  # queued, not refused
            await engine.wake_up(["weights"])
            await engine.wake_up(["kv_cache"])
            engine.resume()
        assert len(got) == 1 and 1 <= got[0] <= 3


async def test_sleep_wake_and_weights_state_machine(model_dir: Path) -> None:
    async with open_local_engine(model_dir) as engine:
        params = SamplingParams(max_tokens=3)
        state = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
        await engine.sleep(1)
        assert engine.sleep_state == {"weights": True, "kv_cache": True}
        with pytest.raises(EngineAsleepError):
            await engine.generate([1, 2], params)
        with pytest.raises(EngineAsleepError):
            await engine.load_weights(state)
        with pytest.raises(ValueError, match="unknown wake_up tags"):
            await engine.wake_up(["gpu"])
        await engine.wake_up(["kv_cache"])
        assert engine.is_sleeping and engine.sleep_state["weights"]
        await engine.wake_up(["weights"])
        assert not engine.is_sleeping
        assert len((await engine.generate([1, 2], params)).token_ids) <= 3

        checksum = engine.weight_checksum()
        await engine.sleep(2)
        await engine.wake_up()
        assert engine.weight_checksum() != checksum  # level 2 discarded the weights
        await engine.load_weights(state)
        assert engine.weight_checksum() == checksum
        assert engine.weight_version == 1
        with pytest.raises(KeyError):
            await engine.load_weights({"nope": torch.zeros(1)})


async def test_keep_pause_runs_no_decode_step_until_resume(model_dir: Path) -> None:
    async with open_local_engine(model_dir) as engine, trio.open_nursery() as nursery:
        done = trio.Event()

        async def long() -> None:
            c = await engine.generate([1, 2], SamplingParams(max_tokens=100, ignore_eos=True))
            assert c.finish_reason == "length" and len(c.token_ids) == 100
            done.set()

        with StepGate(engine, hold={2}) as gate:
            nursery.start_soon(long)
            # paused while its second step runs: that step finishes, no other starts
            await gate.pause_at(2, partial(engine.pause, "keep"))
        frozen = sum(engine.batch_size_counts.values())
        assert frozen == 2
        await trio.sleep(0.3)
        assert sum(engine.batch_size_counts.values()) == frozen
        assert engine.num_requests == 1 and not done.is_set()
        engine.resume()
        await done.wait()


async def test_a_cancelled_caller_leaves_the_batch(model_dir: Path) -> None:
    async with open_local_engine(model_dir) as engine:
        with StepGate(engine, hold={2}) as gate:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(
                    engine.generate, [1, 2], SamplingParams(max_tokens=200, ignore_eos=True)
                )
                await gate.reached(2)  # in flight, its second step held
                nursery.cancel_scope.cancel()  # e.g. a step deadline
            assert engine.num_requests == 0  # left at once, its step still in flight
            gate.release(2)
        # the engine goes on serving (the left request's token of step 2 was dropped)
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        assert len((await engine.generate([1, 2], params)).token_ids) == 2
        assert engine.num_requests == 0


async def test_every_route_but_the_health_probe_needs_the_api_key_when_one_is_set(
    model_dir: Path,
) -> None:
    async with open_local_engine(model_dir) as engine, serving(engine, api_key="s3cret") as url:
        async with httpx.AsyncClient() as http:
            for path in ("/v1/models", "/is_paused", "/engine_stats"):
                response = await http.get(url + path)
                assert response.status_code == 401
                assert response.json()["error"]["code"] == 401
            assert (await http.get(url + "/health")).status_code == 200  # a probe: open
            authed = await http.get(url + "/is_paused", headers={"Authorization": "Bearer s3cret"})
            assert authed.status_code == 200
        async with InferenceClient([url], api_key="s3cret") as client:
            assert (await client.generate([1, 2], SamplingParams(max_tokens=2))).token_ids
            assert await client.is_paused() == [False]


async def test_injected_faults_fire_inside_the_server_on_their_step(model_dir: Path) -> None:
    install_faults("/pause:error=engine fell over@3")
    async with (
        open_local_engine(model_dir) as engine,
        serving(engine) as url,
        InferenceClient([url]) as client,
    ):
        with step_deadline(2, None):
            await client.pause("keep")  # step 2: no fault
        await client.resume()
        with pytest.raises(InferenceServerError) as info, step_deadline(3, None):
            await client.pause("keep")
        assert info.value.status == 500
        assert "engine fell over" in info.value.detail
        assert not engine.is_paused  # the fault fired before the engine was touched


async def test_the_inprocess_client_names_generate_and_fires_its_fault_there(
    model_dir: Path,
) -> None:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    async with open_inprocess_client(model_dir) as client:
        assert len((await client.generate([1, 2], params)).token_ids) == 2  # no fault: works
        try:
            install_faults("generate:error=boom")
            with pytest.raises(FaultInjected) as info:
                await client.generate([1, 2], params)
            install_faults("generate:hang")
            with pytest.raises(StepTimeoutError) as hung, step_deadline(4, 0.2):
                await client.generate([1, 2], params)
        finally:
            install_faults("")
    assert (info.value.operation, info.value.message) == ("generate", "boom")
    assert (hung.value.step, hung.value.operation) == (4, "generate")


async def test_batched_greedy_decoding_matches_transformers_generate(model_dir: Path) -> None:
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [20]]
    results: dict[int, list[int]] = {}
    async with open_local_engine(model_dir) as engine:
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

        async def one(i: int) -> None:
            results[i] = (await engine.generate(prompts[i], greedy)).token_ids

        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        assert max(engine.batch_size_counts) == len(prompts)  # they really shared steps

        for i, prompt in enumerate(prompts):
            expected = await trio.to_thread.run_sync(greedy_reference, engine.model, prompt, 24)
            assert results[i] == expected


async def test_the_inprocess_client_samples_n_like_n_seeded_requests(model_dir: Path) -> None:
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=41)
    async with open_inprocess_client(model_dir) as client:
        together = await client.generate_n([7, 8], params, 3)
        apart = [
            await client.generate(
                [7, 8], SamplingParams(max_tokens=5, ignore_eos=True, seed=41 + i)
            )
            for i in range(3)
        ]
        with pytest.raises(ValueError, match="n must be at least 1"):
            await client.generate_n([7, 8], params, 0)
    assert [c.token_ids for c in together] == [c.token_ids for c in apart]


@pytest.mark.parametrize("batch_wait_s", [0.002, 0.0])
async def test_after_idling_a_burst_of_arrivals_starts_as_one_step(
    model_dir: Path, mock_clock: trio.testing.MockClock, batch_wait_s: float
) -> None:
    # the clock only moves when told to: arrivals 1 ms apart, then 2.5 ms of quiet
    params = SamplingParams(max_tokens=1, ignore_eos=True, seed=0)
    async with open_local_engine(model_dir, batch_wait_s=batch_wait_s) as engine:
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(engine.generate, [5 + i, 6], params)
                await trio.testing.wait_all_tasks_blocked()
                mock_clock.jump(0.001)
            mock_clock.jump(0.0025)
    steps = dict(engine.batch_size_counts)  # one token each: one step per request batch
    if batch_wait_s:
        assert steps == {3: 1}
    else:  # the first arrival starts alone; the others join after it
        assert steps.get(1, 0) >= 1 and 3 not in steps, steps
