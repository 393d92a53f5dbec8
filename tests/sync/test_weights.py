"""``sync_weights``: the transfer never freezes the loop, is not abandoned before
its deadline plus grace, and the engine bracket runs its steps in order whatever happens to
the transfer (abandonment itself: ``tests/sync/test_bracket_orders.py``, real server).

The engine is a recording fake; the transfer is a real blocking thread (``time.sleep``, or
held until the test releases it), followed by a cancellable engine call, so only
``sync_weights`` itself can keep a cancellation from cutting the transfer short.
A cancellation lands mid-transfer from inside the thread, and a deadline passes mid-transfer
on ``mock_clock``, moved while the held thread runs: never a race of the thread's sleep
against a wall-clock deadline.
"""

from __future__ import annotations

import functools
import threading
import time

import pytest
import trio
import trio.testing

from sync.bracket import Bracket
from sync.weights import abandoned_detail, sync_weights
from trainer.errors import StepTimeoutError, WeightSyncTimeoutError
from trainer.vocabulary import install_faults, step_deadline


class RecordingEngine:
    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.paused = trio.Event()

    async def pause(self, mode: str = "keep") -> None:
        self.events.append("paused")
        self.paused.set()

    async def resume(self) -> None:
        self.events.append("resumed")

    async def sleep(self, level: int = 1, mode: str | None = None) -> None:
        self.events.append("sleep")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self.events.append("wake_" + "+".join(tags or ["all"]))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await trio.lowlevel.checkpoint()  # as a request would: a cancelled sync never resets
        self.events.append("reset_prefix_cache")


class BlockingTransport:
    """A bucket written by a real blocking thread, then an engine call that finishes the update.

    The thread is awaited without abandoning it (a transfer's writing thread); the finishing
    call is an ordinary cancellable await, as ``/finish_weight_update`` is.
    """

    def __init__(self, events: list[str], seconds: float, fail: str | None = None) -> None:
        self.events = events
        self.seconds = seconds
        self.fail = fail
        self.started = trio.Event()
        self.thread_started = threading.Event()

    async def init(self, engine: object, workers: object) -> None:
        return None

    def _write_bucket(self) -> None:
        self.thread_started.set()
        time.sleep(self.seconds)
        if self.fail:
            self.events.append("broadcast_failed")
            raise RuntimeError(self.fail)
        self.events.append("bucket_written")

    async def transfer(
        self, engine: object, workers: object, *, weight_version: int | None = None
    ) -> None:
        self.started.set()
        await trio.to_thread.run_sync(self._write_bucket)
        await trio.sleep(0.01)  # /finish_weight_update
        self.events.append("broadcast_done")


@pytest.mark.parametrize("blocking_in", ["transport", "fault"])
async def test_the_transfer_does_not_block_the_event_loop(blocking_in):
    events: list[str] = []
    if blocking_in == "fault":  # a slow transfer as users rehearse it: a blocking sleep
        install_faults("broadcast_to_inference_engines:sleep=0.5")
    transport = BlockingTransport(events, 0.5 if blocking_in == "transport" else 0.0)
    engine = RecordingEngine(events)
    result: dict[str, float] = {}

    async def sync() -> None:
        result.update(await sync_weights(engine, None, transport))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sync)
        await engine.paused.wait()
        await trio.testing.wait_all_tasks_blocked()  # the sync waits for its thread
        # a loop frozen by the 0.5 s transfer would get here only after the bucket was written
        assert "bucket_written" not in events and "broadcast_done" not in events
        assert not result
    assert result["sync/last_weight_sync_seconds"] >= 0.5
    assert events == [
        "paused",
        "bucket_written",
        "broadcast_done",
        "reset_prefix_cache",
        "resumed",
    ]


async def test_a_cancellation_waits_for_the_transfer_before_resuming():
    events: list[str] = []
    async with trio.open_nursery() as nursery:
        transport = CancelAfterThread(events, 0.3, nursery.cancel_scope)  # once its thread runs
        nursery.start_soon(sync_weights, RecordingEngine(events), None, transport)
    assert events == ["paused", "bucket_written", "broadcast_done", "resumed"]


class HeldTransport(BlockingTransport):
    """A transfer whose thread runs until the test releases it, for tests on ``mock_clock``
    (which moves only when told): a deadline passes mid-transfer when the test moves the clock
    while the thread runs, however fast or slow the machine."""

    def __init__(self, events: list[str], fail: str | None = None) -> None:
        super().__init__(events, 0.0, fail)
        self.release = threading.Event()

    def _write_bucket(self) -> None:
        self.thread_started.set()
        self.release.wait(60)
        super()._write_bucket()

    async def transfer(
        self, engine: object, workers: object, *, weight_version: int | None = None
    ) -> None:
        self.started.set()
        await trio.to_thread.run_sync(self._write_bucket)
        await trio.lowlevel.checkpoint()  # /finish_weight_update (the clock stands still)
        self.events.append("broadcast_done")


async def _past_the_deadline_mid_transfer(
    clock: trio.testing.MockClock, transport: HeldTransport, seconds: float
) -> None:
    """Once the transfer's thread runs, move the clock ``seconds`` on, then let it finish."""
    await trio.to_thread.run_sync(transport.thread_started.wait, 60)
    clock.jump(seconds)
    await trio.testing.wait_all_tasks_blocked()  # the expired deadline has cancelled its scope
    transport.release.set()


async def test_a_deadline_mid_transfer_raises_its_error_after_the_transfer_finishes(mock_clock):
    events: list[str] = []
    transport = HeldTransport(events)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_past_the_deadline_mid_transfer, mock_clock, transport, 0.5)
        with pytest.raises(WeightSyncTimeoutError) as info:
            with step_deadline(3, 0.1, WeightSyncTimeoutError):
                await sync_weights(RecordingEngine(events), None, transport)
    assert info.value.operation == "broadcast_to_inference_engines"
    assert info.value.detail is None  # finished within its grace: not abandoned
    # the transfer finished within its grace (sync.transfer_grace_s), but the deadline had
    # passed: resuming is skipped (rule 7) and says so
    assert events == ["paused", "bucket_written", "broadcast_done"]
    assert any("/resume" in n for n in getattr(info.value, "__notes__", ()))


async def test_a_cancellation_then_a_failed_transfer_chains_the_transfer_error(mock_clock):
    events: list[str] = []
    transport = HeldTransport(events, fail="bucket 3 went missing")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_past_the_deadline_mid_transfer, mock_clock, transport, 0.5)
        with pytest.raises(WeightSyncTimeoutError) as info:
            with step_deadline(2, 0.1, WeightSyncTimeoutError):
                await sync_weights(RecordingEngine(events), None, transport)
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and str(cause) == "bucket 3 went missing"
    assert events == ["paused", "broadcast_failed"]


async def test_a_failed_transfer_without_cancellation_raises_its_own_error_and_resumes():
    events: list[str] = []
    transport = BlockingTransport(events, 0.05, fail="boom")
    with pytest.raises(RuntimeError, match="boom"):
        await sync_weights(RecordingEngine(events), None, transport)
    assert events == ["paused", "broadcast_failed", "resumed"]


class CancelAfterThread(BlockingTransport):
    """Cancels ``scope`` from inside the transfer, once its thread is running."""

    def __init__(self, events: list[str], seconds: float, scope: trio.CancelScope) -> None:
        super().__init__(events, seconds)
        self.scope = scope

    def _write_bucket(self) -> None:
        trio.from_thread.run_sync(self.scope.cancel)
        super()._write_bucket()


@pytest.mark.parametrize("outcome", ["failure", "cancellation"])
async def test_offload_kv_fully_async_wakes_kv_before_resuming(outcome):
    events: list[str] = []
    engine = RecordingEngine(events)
    with trio.CancelScope() as scope:
        if outcome == "failure":
            transport = BlockingTransport(events, 0.2, fail="broken pipe")
        else:
            transport = CancelAfterThread(events, 0.2, scope)
        with (
            pytest.raises(RuntimeError, match="broken pipe")
            if outcome == "failure"
            else _no_raise()
        ):
            await sync_weights(engine, None, transport, bracket=Bracket.PAUSE_OFFLOAD_KV)
    done = "broadcast_failed" if outcome == "failure" else "broadcast_done"
    assert [e for e in events if e != "bucket_written"] == [
        "paused",
        "sleep",
        "wake_weights",
        done,
        "wake_kv_cache",
        "resumed",
    ]


@pytest.mark.parametrize("outcome", ["success", "failure", "cancellation"])
async def test_offload_kv_sync_trainer_always_wakes_kv_after_the_transfer(outcome):
    events: list[str] = []
    engine = RecordingEngine(events)
    with trio.CancelScope() as scope:
        if outcome == "cancellation":
            transport: BlockingTransport = CancelAfterThread(events, 0.2, scope)
        else:
            transport = BlockingTransport(events, 0.2, fail="x" if outcome == "failure" else None)
        with pytest.raises(RuntimeError) if outcome == "failure" else _no_raise():
            await sync_weights(engine, None, transport, bracket=Bracket.OFFLOAD_KV)
    done = "broadcast_failed" if outcome == "failure" else "broadcast_done"
    assert [e for e in events if e != "bucket_written"] == [
        "sleep",
        "wake_weights",
        done,
        "wake_kv_cache",
    ]


@pytest.mark.parametrize("outcome", ["success", "failure"])
async def test_colocated_wakes_weights_then_transfers_then_wakes_kv(outcome):
    events: list[str] = []
    transport = BlockingTransport(events, 0.05, fail="x" if outcome == "failure" else None)
    with pytest.raises(RuntimeError) if outcome == "failure" else _no_raise():
        await sync_weights(RecordingEngine(events), None, transport, bracket=Bracket.COLOCATED)
    done = "broadcast_failed" if outcome == "failure" else "broadcast_done"
    assert [e for e in events if e != "bucket_written"] == ["wake_weights", done, "wake_kv_cache"]


def _no_raise():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.parametrize(("sync_s", "step_s"), [(20.0, 30.0), (20.0, 25.0)])
async def test_an_abandoned_transfer_names_the_deadline_that_fired_first(
    autojump_clock, sync_s, step_s
):
    """Issue 16's own numbers: a weight sync of 20 s inside a step of 30 s, the default 10 s
    grace. The transfer is abandoned at 20 + 10 s, after the step's deadline has also fired;
    the error is still the sync's, the budget that ran out first (it was the step's)."""
    events: list[str] = []
    install_faults("broadcast_to_inference_engines:hang")  # the thread never returns
    t0 = trio.current_time()
    with pytest.raises(StepTimeoutError) as info:
        with step_deadline(2, step_s, StepTimeoutError):
            await trio.sleep(1.0)  # the step's stages before its sync
            with step_deadline(2, sync_s, WeightSyncTimeoutError):
                await sync_weights(
                    RecordingEngine(events), None, BlockingTransport(events, 0), grace_s=10.0
                )
    assert type(info.value) is WeightSyncTimeoutError
    assert info.value.budget_s == sync_s and info.value.detail == abandoned_detail(10.0)
    assert trio.current_time() - t0 == pytest.approx(1.0 + sync_s + 10.0)
    assert events == ["paused"]  # no resume onto partial weights


@pytest.mark.timeout(60)  # before the fix this waited for the hung thread forever
async def test_a_cancellation_without_a_deadline_abandons_a_hung_transfer_after_its_grace(
    autojump_clock,
):
    """Ctrl-C under the default config (no step or sync deadline): the cancellation waits for
    the hung transfer ``grace_s`` (``sync.transfer_grace_s``), not for ever, then goes on; the
    engines are left paused, as after any abandoned transfer."""
    events: list[str] = []
    install_faults("broadcast_to_inference_engines:hang")  # the thread never returns
    t0 = trio.current_time()
    with trio.CancelScope() as interrupt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                functools.partial(
                    sync_weights,
                    RecordingEngine(events),
                    None,
                    BlockingTransport(events, 0),
                    grace_s=10.0,
                )
            )
            await trio.sleep(5.0)  # Ctrl-C, 5 s into the transfer
            interrupt.cancel()
    assert interrupt.cancelled_caught
    assert trio.current_time() - t0 == pytest.approx(5.0 + 10.0)
    assert events == ["paused"]  # no resume onto partial weights


async def test_a_cancellation_without_a_deadline_still_waits_for_a_transfer_within_its_grace(
    mock_clock,
):
    """Rule 6 holds inside the grace: a transfer that finishes 0.5 s after the cancellation is
    waited for, and the engines resume onto its complete weights."""
    events: list[str] = []
    transport = HeldTransport(events)
    with trio.CancelScope() as interrupt:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sync_weights, RecordingEngine(events), None, transport)
            await trio.to_thread.run_sync(transport.thread_started.wait, 60)
            interrupt.cancel()
            mock_clock.jump(0.5)
            transport.release.set()
    assert interrupt.cancelled_caught
    assert events == ["paused", "bucket_written", "broadcast_done", "resumed"]
