"""A transfer that broke off after reaching the engines is never followed by generation on
partial weights: the trainer sends the weights once more, and resumes only once that one is
complete; if it cannot be, the engines stay paused and the run ends with ``EngineUnusableError``.

Against a real reference server (its ``GET /control_log`` shows what it received, in order).
The mid-transfer faults fire on the trainer's side (``transfer_after_first_bucket``,
``transfer_before_finish``: once per sync), so the same specs work against real vLLM
(``tests/engines/vllm/test_broken_transfer_vllm.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from engines.client import InferenceClient
from sync.transports import DiskTransport
from sync.weights import sync_weights
from tests.sync.test_bracket_orders import (
    SHAPES,
    TRANSFER,
    disk_sync_setup,
    recorded_calls,
)
from trainer.errors import EngineUnusableError, FaultInjected, WeightSyncTimeoutError
from trainer.vocabulary import current_deadline, install_faults, step_deadline

START, UPDATE, FINISH = TRANSFER


@pytest.fixture(autouse=True)
def _no_faults_after():
    yield
    install_faults(None)


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_a_transfer_broken_off_before_its_finish_is_finished_before_generation_resumes(
    client: InferenceClient, tmp_path: Path, shape: str
) -> None:
    kwargs, before, after = SHAPES[shape]
    workers, transport = await disk_sync_setup(client, tmp_path)
    install_faults("transfer_before_finish:error=boom")
    async with recorded_calls(client) as calls:
        metrics = await sync_weights(client, workers, transport, **kwargs)
    # every bucket was in: the update is finished (real vLLM refuses a second start while
    # one is open), and only then the bracket's cleanups and the prefix-cache reset
    assert calls == [*before, START, UPDATE, FINISH, *after]
    assert metrics["sync/resends"] == 1.0
    assert await client.is_paused() == [False]


async def test_a_transfer_broken_off_with_buckets_missing_leaves_the_engines_paused(
    client: InferenceClient, tmp_path: Path
) -> None:
    workers, transport = await disk_sync_setup(client, tmp_path)
    transport.bucket_bytes = 1024  # several buckets: the first in, the others missing
    install_faults("transfer_after_first_bucket:error=boom")
    with pytest.raises(EngineUnusableError, match="buckets missing") as info:
        async with recorded_calls(client) as calls:
            await sync_weights(client, workers, transport)
    # its finish closes the open update (so the next complete sync is accepted); no resume
    assert calls == ["/pause?mode=keep", START, UPDATE, FINISH]
    assert await client.is_paused() == [True]
    assert isinstance(info.value.__cause__, FaultInjected)


class FailingAfterStart(DiskTransport):
    """A transfer that starts the update, then fails, every time (an engine that keeps
    failing its updates)."""

    async def transfer(self, engine, workers, *, weight_version=None) -> None:
        await engine.control("POST", "/start_weight_update", json={})
        raise RuntimeError("bucket 1 is unreadable")


async def test_when_the_re_send_fails_too_the_engines_stay_paused_and_the_error_names_them(
    client: InferenceClient, tmp_path: Path
) -> None:
    workers, _ = await disk_sync_setup(client, tmp_path)
    transport = FailingAfterStart(tmp_path / "sync", bucket_bytes=1 << 30)
    with pytest.raises(EngineUnusableError) as info:
        async with recorded_calls(client) as calls:
            await sync_weights(client, workers, transport)
    assert calls == ["/pause?mode=keep", START, FINISH]  # closed, best effort; never resumed
    assert await client.is_paused() == [True]
    assert info.value.urls == list(client.urls)
    assert isinstance(info.value.__cause__, RuntimeError)  # chained to the transfer's error


async def test_a_failure_before_the_transfer_reaches_the_engines_is_not_sent_again(
    client: InferenceClient, tmp_path: Path
) -> None:
    workers, transport = await disk_sync_setup(client, tmp_path)
    install_faults("broadcast_to_inference_engines:error=boom")
    with pytest.raises(FaultInjected):
        async with recorded_calls(client) as calls:
            await sync_weights(client, workers, transport)
    assert calls == ["/pause?mode=keep", "/resume"]  # the engines' weights were never touched


class SlowAfterStart(DiskTransport):
    """Starts the update, then outlives the sync's deadline (within its grace) and fails."""

    async def transfer(self, engine, workers, *, weight_version=None) -> None:
        await engine.control("POST", "/start_weight_update", json={})
        await trio.sleep_until(current_deadline() + 0.2)  # the transfer runs shielded
        raise RuntimeError("too slow")


async def test_a_deadline_past_mid_transfer_leaves_the_engines_paused_and_says_so(
    client: InferenceClient, tmp_path: Path
) -> None:
    workers, _ = await disk_sync_setup(client, tmp_path)
    transport = SlowAfterStart(tmp_path / "sync", bucket_bytes=1 << 30)
    with pytest.raises(WeightSyncTimeoutError) as info:
        with step_deadline(2, 2.0, WeightSyncTimeoutError):
            await sync_weights(client, workers, transport, grace_s=30)
    assert await client.is_paused() == [True]  # no time to send again: never resumed
    notes = " ".join(getattr(info.value, "__notes__", ()))
    assert "left paused and unusable" in notes and "no time was left" in notes
