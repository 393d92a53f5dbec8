"""The local worker group: calls run off the event loop, and a hung worker times out at its call site."""

from __future__ import annotations

import threading
import time
from collections.abc import Awaitable, Callable
from functools import partial

import pytest
import trio
import trio.testing

from engines.models import build_tiny_model
from trainer.errors import StepTimeoutError
from trainer.vocabulary import Timer, install_faults, step_deadline
from trainer.workers.local import LocalWorkerGroup


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model()


async def test_a_worker_hung_in_backload_times_out_through_the_group_call_site(model_dir):
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    install_faults("backload_to_gpu:hang@1")
    t0 = time.monotonic()
    with pytest.raises(StepTimeoutError) as info:
        with step_deadline(1, 1.0), Timer("train_critic_and_policy"):
            await group.backload_to_gpu()  # the worker thread really blocks, forever
    assert (info.value.step, info.value.stage, info.value.operation) == (
        1,
        "train_critic_and_policy",
        "backload_to_gpu",
    )
    assert time.monotonic() - t0 < 30  # generous: the driver's wait ended at the deadline
    # the hung thread still holds the worker: a second call waits (bounded) instead of racing it
    with trio.move_on_after(0.5) as scope:
        await group.offload_to_cpu()
    assert scope.cancelled_caught


async def test_the_event_loop_keeps_running_while_a_worker_computes(model_dir):
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    install_faults("optim_step:sleep=1")  # a real blocking second inside the worker thread
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(tick)
        await group.optim_step()
        nursery.cancel_scope.cancel()
    assert ticks >= 3  # a blocking optim_step on the loop would have allowed at most one


async def test_shutdown_waits_for_a_call_abandoned_mid_computation(model_dir):
    """A cancelled wait abandons the thread; shutdown lets it finish before the process may
    exit (exiting while a thread is inside a torch kernel can abort the process)."""
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    started, release = threading.Event(), threading.Event()
    order: list[str] = []

    def compute() -> dict[str, float]:
        started.set()
        release.wait(30)  # a long optimizer step, really blocking its thread
        order.append("computation returned")
        return {}

    group.policy.optim_step = compute  # type: ignore[method-assign]
    await _abandon_once(group.optim_step, started)

    async def shut_down() -> None:
        await group.shutdown()
        order.append("shutdown returned")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shut_down)
        await trio.testing.wait_all_tasks_blocked()  # shutdown waits for the computation
        assert order == []
        release.set()
    assert order == ["computation returned", "shutdown returned"]


async def _abandon_once(call: Callable[..., Awaitable[object]], started: threading.Event, *args):
    """Call ``call(*args)`` and cancel the wait once ``started`` is set (its thread runs)."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, *args)
        assert await trio.to_thread.run_sync(started.wait, 60)
        nursery.cancel_scope.cancel()


def _wait_in_rendezvous(model, started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(60)


async def test_shutdown_leaves_a_rank0_call_left_waiting_at_once(model_dir):
    """A transport's rank-0 call given up on (a group join, a hung transfer) only waits, bounded
    by its own timeout: exiting does not wait for it (before, a failed group init held the
    run's exit for SHUTDOWN_WAIT_S)."""
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    started, release = threading.Event(), threading.Event()
    try:
        rank0 = partial(group.run_on_rank0, abandon_on_cancel=True)
        await _abandon_once(rank0, started, _wait_in_rendezvous, started, release)
        with trio.fail_after(10):  # well under SHUTDOWN_WAIT_S
            await group.shutdown()
    finally:
        release.set()


async def test_shutdown_leaves_a_thread_held_by_a_hang_fault_at_once(model_dir, tmp_path):
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    fired = tmp_path / "faults_fired.log"
    install_faults("offload_to_cpu:hang", fired_log=fired)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(group.offload_to_cpu)  # the thread waits in the fault, not in a kernel
        with trio.fail_after(60):  # the fault appends to the file as it fires
            while not fired.read_text():  # noqa: ASYNC110
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):  # well under SHUTDOWN_WAIT_S
        await group.shutdown()


async def test_shutdown_does_not_wait_for_a_call_an_error_fault_ended(model_dir):
    """A call that an ``error`` fault ended never computed: shutdown returns at once (before,
    the call was counted as computing forever and every such failed run waited
    SHUTDOWN_WAIT_S to exit)."""
    group = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    install_faults("offload_to_cpu:error=boom")
    with pytest.raises(Exception, match="boom"):
        await group.offload_to_cpu()
    with trio.fail_after(10):  # well under SHUTDOWN_WAIT_S
        await group.shutdown()
