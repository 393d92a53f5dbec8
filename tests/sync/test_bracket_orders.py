"""The engine brackets of ``sync_weights``, as a real reference server sees them.

One server (a real process, started by ``engines.launch``) serves the module; each test runs
a real disk sync from a real worker group through a real ``InferenceClient`` and reads the
control-plane calls the server received, in order, from its ``GET /control_log``. A failed
transfer is the ``broadcast_to_inference_engines`` fault: it raises where the transfer runs,
before any weight-transfer call, so the server sees the bracket alone.
"""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

import trainer.run
from engines.client import InferenceClient
from engines.launch import EngineUrls
from engines.models import build_tiny_model
from sync.bracket import Bracket
from sync.transports import DiskTransport
from sync.weights import abandoned_detail, sync_weights
from trainer.config import Config, load_config
from trainer.errors import FaultInjected, WeightSyncTimeoutError
from trainer.vocabulary import install_faults, step_deadline
from trainer.workers.local import LocalWorkerGroup

#: What the server sees of one disk transfer (the bucket size keeps it to one bucket).
TRANSFER = ["/start_weight_update", "/update_weights", "/finish_weight_update"]
ONE_BUCKET = 1 << 30

#: sync_weights's keyword arguments -> the calls around the transfer.
SHAPES: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {
    "non-colocated": (
        {},
        ["/pause?mode=keep"],
        ["/reset_prefix_cache?reset_running_requests=true", "/resume"],
    ),
    "colocated": (
        {"bracket": Bracket.COLOCATED},
        ["/wake_up?tags=weights"],
        ["/wake_up?tags=kv_cache"],
    ),
    "offload-kv": (
        {"bracket": Bracket.OFFLOAD_KV},
        ["/sleep?level=1", "/wake_up?tags=weights"],
        ["/wake_up?tags=kv_cache"],
    ),
    "offload-kv-fully-async": (
        {"bracket": Bracket.PAUSE_OFFLOAD_KV, "pause_mode": "abort"},
        ["/pause?mode=abort", "/sleep?level=1", "/wake_up?tags=weights"],
        ["/wake_up?tags=kv_cache", "/resume"],
    ),
}


def cleanups(after: list[str]) -> list[str]:
    """The calls after the transfer that are cleanups (run even when it failed)."""
    return [call for call in after if not call.startswith("/reset_prefix_cache")]


@asynccontextmanager
async def recorded_calls(client: InferenceClient) -> AsyncIterator[list[str]]:
    """Yields a list that, once the block exits (even by an error), holds the control-plane
    calls the server received during the block, in order."""
    (url,) = client.urls
    calls: list[str] = []
    async with httpx.AsyncClient(timeout=30, headers=client.headers) as http:
        before = (await http.get(f"{url}/control_log")).json()["total"]
        try:
            yield calls
        finally:
            log = (await http.get(f"{url}/control_log")).json()
            new = log["total"] - before
            assert 0 < new <= len(log["calls"])
            calls += log["calls"][-new:]


async def disk_sync_setup(
    client: InferenceClient, tmp_path: Path
) -> tuple[LocalWorkerGroup, DiskTransport]:
    """A real worker group and a disk transport, initialised against the server."""
    workers = await LocalWorkerGroup.create(
        build_tiny_model(), policy_kwargs={"lr": 1e-3}, with_ref=False
    )
    transport = DiskTransport(tmp_path / "sync", bucket_bytes=ONE_BUCKET)
    await transport.init(client, workers)
    return workers, transport


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_the_server_sees_each_bracket_around_the_transfer_in_order(
    client: InferenceClient, tmp_path: Path, shape: str
) -> None:
    kwargs, before, after = SHAPES[shape]
    workers, transport = await disk_sync_setup(client, tmp_path)
    async with recorded_calls(client) as calls:
        await sync_weights(client, workers, transport, **kwargs)
    assert calls == [*before, *TRANSFER, *after]
    assert await client.is_paused() == [False]
    assert await client.is_sleeping() == [False]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_failed_transfer_still_runs_each_brackets_cleanups_in_order(
    client: InferenceClient, tmp_path: Path, shape: str
) -> None:
    kwargs, before, after = SHAPES[shape]
    workers, transport = await disk_sync_setup(client, tmp_path)
    install_faults("broadcast_to_inference_engines:error=boom")
    with pytest.raises(FaultInjected, match="boom"):
        async with recorded_calls(client) as calls:
            await sync_weights(client, workers, transport, **kwargs)
    # fully-async: the KV wake precedes the resume, so generation resumes onto a live cache;
    # the prefix cache is reset only after a transfer that finished
    assert calls == [*before, *cleanups(after)]
    assert await client.is_paused() == [False]
    assert await client.is_sleeping() == [False]


# ------------------------------------ a transfer hung past its deadline + grace is abandoned

#: The sync's budget and grace in these tests (seconds): long enough for the bracket's calls
#: before the transfer on a busy machine, short enough to keep the tests quick.
BUDGET_S, GRACE_S = 3.0, 1.0


def _wait_for(model: Any, release: threading.Event) -> None:
    """Rank 0 blocked in a real thread until released: a collective that never returns."""
    release.wait()


class StuckRank0Transport:
    """Starts an update on the server, then rank 0's part never returns."""

    def __init__(self) -> None:
        self.release = threading.Event()

    async def init(self, engine: Any, workers: Any) -> None:
        return None

    async def transfer(self, engine: Any, workers: Any, *, weight_version: Any = None) -> None:
        await engine.control("POST", "/start_weight_update", json={})
        await workers.run_on_rank0(_wait_for, self.release)

    async def close(self, workers: Any) -> None:
        return None


@pytest.mark.parametrize(
    ("shape", "stuck"),
    [
        ("non-colocated", "fault"),
        ("offload-kv-fully-async", "fault"),
        ("non-colocated", "rank0"),
    ],
)
async def test_a_transfer_hung_past_its_grace_is_abandoned_and_the_engine_left_paused(
    client: InferenceClient, tmp_path: Path, shape: str, stuck: str
) -> None:
    kwargs, before, _after = SHAPES[shape]
    workers, transport = await disk_sync_setup(client, tmp_path)
    if stuck == "fault":  # the transfer's own thread hangs (released at the test's end)
        install_faults("broadcast_to_inference_engines:hang")
        hung: Any = transport
    else:  # rank 0's call hangs in the worker group's thread
        hung = StuckRank0Transport()
    t0 = trio.current_time()
    try:
        with pytest.raises(WeightSyncTimeoutError) as info:
            async with recorded_calls(client) as calls:
                with step_deadline(2, BUDGET_S, WeightSyncTimeoutError):
                    await sync_weights(client, workers, hung, grace_s=GRACE_S, **kwargs)
        waited = trio.current_time() - t0
    finally:
        if stuck == "rank0":
            hung.release.set()
    error = info.value
    assert error.detail == abandoned_detail(GRACE_S)
    assert "abandoned" in str(error) and "left paused" in str(error)
    assert error.operation == "broadcast_to_inference_engines"
    # it ended at the bound, not when the hang ended (never, or at the test's end)
    assert BUDGET_S + GRACE_S <= waited < BUDGET_S + GRACE_S + 30
    # the bracket's own calls, then nothing: no resume or KV wake onto partial weights
    sent = ["/start_weight_update"] if stuck == "rank0" else []
    assert calls == [*before, *sent]
    if "/pause" in before[0]:
        assert await client.is_paused() == [True]


# ------------------------------------------------ the fully-async bracket, reached by a real run


def _offloading_async_run(url: str, run_dir: Path, faults: str) -> Config:
    """A fully-async run against the server that frees its KV cache for each weight sync."""
    return load_config(
        None,
        [
            "engine.backend=remote",
            f"engine.urls=[{url}]",
            "engine.offload_kv_for_weight_sync=true",
            "engine.pause_mode=abort",
            "trainer.strategy=fully_async",
            "trainer.max_steps=3",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            f"sync.bucket_size_mb={ONE_BUCKET >> 20}",
            "trainer.progress=false",
            f"trainer.run_dir={run_dir}",
            f"faults={faults}",
        ],
    )


#: The sync after step 2 as the server sees it: pause, free the KV cache, wake the weights;
#: then (transfer) -> KV cache awake -> generation resumed, whatever became of the transfer.
ASYNC_BEFORE = ["/pause?mode=abort", "/sleep?level=1", "/wake_up?tags=weights"]
ASYNC_AFTER = ["/wake_up?tags=kv_cache", "/resume"]


async def test_a_fully_async_run_whose_transfer_fails_restores_the_engine_in_order(
    client: InferenceClient, tmp_path: Path, server_urls: EngineUrls, monkeypatch
) -> None:
    monkeypatch.setenv("TRAINER_ENGINE_API_KEY", server_urls.api_key)
    cfg = _offloading_async_run(
        client.urls[0], tmp_path, "broadcast_to_inference_engines:error=boom@2"
    )
    with pytest.raises(FaultInjected, match="boom"):
        async with recorded_calls(client) as calls:
            await trainer.run.train(cfg)
    # the first sync, the one after step 1, then step 2's: its transfer failed before any call
    assert calls[-len(ASYNC_BEFORE + ASYNC_AFTER) :] == [*ASYNC_BEFORE, *ASYNC_AFTER]
    assert calls.count("/finish_weight_update") == 2  # the two syncs before it did transfer
    assert await client.is_paused() == [False]
    assert await client.is_sleeping() == [False]


async def test_a_fully_async_run_cancelled_mid_transfer_finishes_it_then_restores_the_engine(
    client: InferenceClient, tmp_path: Path, server_urls: EngineUrls, monkeypatch
) -> None:
    monkeypatch.setenv("TRAINER_ENGINE_API_KEY", server_urls.api_key)
    cfg = _offloading_async_run(
        client.urls[0], tmp_path, "broadcast_to_inference_engines:sleep=2@2"
    )
    fired = tmp_path / "faults_fired.log"
    async with recorded_calls(client) as calls:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(trainer.run.train, cfg)
                # the run's fired-faults file says the slow transfer has begun
                while not (fired.exists() and fired.read_text()):  # noqa: ASYNC110
                    await trio.sleep(0.05)
                scope.cancel()  # Ctrl-C or a failed rollout, while the slow transfer runs
    assert scope.cancelled_caught
    # the cancellation waited for the transfer, then the KV wake, then the resume
    assert calls[-len(ASYNC_BEFORE + TRANSFER + ASYNC_AFTER) :] == [
        *ASYNC_BEFORE,
        *TRANSFER,
        *ASYNC_AFTER,
    ]
    assert await client.is_paused() == [False]
    assert await client.is_sleeping() == [False]
