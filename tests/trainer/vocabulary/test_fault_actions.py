"""Fault injection (DESIGN 4.5): what each action really does where it fires (the event loop, a
thread, a child process), and the faults that never fired."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio
import trio.testing

from trainer.errors import FaultInjected, StepTimeoutError
from trainer.vocabulary import (
    FAULTS_ENV,
    Fault,
    FaultAction,
    Timer,
    fire_fault,
    fire_fault_sync,
    install_faults,
    operation,
    release_hangs,
    step_deadline,
    unfired_faults,
)

ROOT = Path(__file__).resolve().parents[3]


# --- delay, sleep, hang ------------------------------------------------------------------


async def test_delay_waits_without_blocking_the_event_loop(autojump_clock):
    install_faults("/pause:delay=3")
    order: list[str] = []

    async def other_task() -> None:
        await trio.sleep(1)
        order.append("other task ran at t=1")

    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await fire_fault("/pause")
        order.append("/pause returned at t=3")
    assert order == ["other task ran at t=1", "/pause returned at t=3"]
    assert trio.current_time() - start == pytest.approx(3)


async def test_delay_is_cancellable(autojump_clock):
    install_faults("/pause:delay=100")
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(1, 10),
        Timer("sync_weights"),
        operation("/pause"),
    ):
        await fire_fault("/pause")
    assert (info.value.elapsed_s, info.value.operation) == (pytest.approx(10), "/pause")


async def test_blocking_faults_refuse_to_block_the_trio_thread():
    install_faults("generate:hang,env_step:sleep=1,forward:delay=1")
    for op in ("env_step", "forward", "generate"):  # the hang last: without the guard it blocks
        with pytest.raises(RuntimeError, match="would block the trio thread"):
            fire_fault_sync(op)


async def test_sleep_blocks_the_thread_where_it_fires_but_not_the_event_loop():
    install_faults("broadcast_to_inference_engines:sleep=1")
    order: list[str] = []
    in_transfer = trio.Event()
    token = trio.lowlevel.current_trio_token()

    def transfer() -> float:
        trio.from_thread.run_sync(in_transfer.set, trio_token=token)
        t0 = time.monotonic()
        fire_fault_sync("broadcast_to_inference_engines")
        return time.monotonic() - t0

    async def run_transfer() -> None:
        blocked_for = await trio.to_thread.run_sync(transfer)
        order.append("transfer done")
        assert blocked_for >= 1

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_transfer)
        await in_transfer.wait()
        for _ in range(3):
            await trio.lowlevel.checkpoint()
        order.append("event loop served another task")
    assert order == ["event loop served another task", "transfer done"]


async def test_sleep_in_trio_code_runs_off_the_loop_and_is_not_cancellable():
    install_faults("/update_weights:sleep=0.5")
    order: list[str] = []

    async def cancel_once_blocked(scope: trio.CancelScope) -> None:
        # Runs only because the sleep is off the trio thread; the main task is blocked in it.
        await trio.testing.wait_all_tasks_blocked()
        order.append("the loop ran and cancelled the step")
        scope.cancel()

    t0 = time.monotonic()
    async with trio.open_nursery() as nursery:
        with trio.CancelScope() as scope:
            nursery.start_soon(cancel_once_blocked, scope)
            await fire_fault("/update_weights")
            order.append("the slow transfer finished anyway")
    assert time.monotonic() - t0 >= 0.5
    assert order == ["the loop ran and cancelled the step", "the slow transfer finished anyway"]


async def test_hang_in_trio_code_never_returns(autojump_clock):
    install_faults("/pause:hang@2")
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(2, 10**4),
        Timer("sync_weights"),
        operation("/pause"),
    ):
        await fire_fault("/pause")
    assert info.value.elapsed_s == pytest.approx(10**4)
    assert (info.value.stage, info.value.operation) == ("sync_weights", "/pause")


async def _until_fired(fired: Path) -> None:
    """Until the fired-faults file names a fault (it is written just before a hang blocks)."""
    with trio.fail_after(60):
        while not await trio.Path(fired).read_text():  # noqa: ASYNC110 - by a thread
            await trio.sleep(0.01)


async def test_hang_really_blocks_a_worker_thread_until_the_step_deadline_names_it(tmp_path):
    fired = tmp_path / "faults_fired.log"
    install_faults("backload_to_gpu:hang@3", fired_log=fired)
    exited = threading.Event()
    outcome: list[BaseException] = []

    def backload_to_gpu() -> None:
        try:
            fire_fault_sync("backload_to_gpu")
        except BaseException as exc:
            outcome.append(exc)
        finally:
            exited.set()

    t0 = time.monotonic()
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(3, 0.5),
        Timer("sync_weights"),
        operation("backload_to_gpu"),
    ):
        await trio.to_thread.run_sync(backload_to_gpu, abandon_on_cancel=True)
    waited = time.monotonic() - t0
    err = info.value
    assert type(err) is StepTimeoutError
    assert (err.step, err.budget_s, err.stage, err.operation) == (
        3,
        0.5,
        "sync_weights",
        "backload_to_gpu",
    )
    assert 0.5 <= err.elapsed_s < 10
    assert 0.5 <= waited < 10
    # Only the driver's wait was interrupted: the worker is still hung.
    await _until_fired(fired)  # in the hang (not still on its way), so the release wakes it
    assert not exited.is_set()

    release_hangs()  # test-only
    assert await trio.to_thread.run_sync(exited.wait, 10)
    assert len(outcome) == 1 and isinstance(outcome[0], FaultInjected)
    assert outcome[0].step == 3


async def test_a_hang_that_fires_after_a_release_blocks_again(tmp_path):
    fired = tmp_path / "faults_fired.log"
    install_faults("offload_to_cpu:hang", fired_log=fired)
    release_hangs()
    done = threading.Event()

    def offload() -> None:
        try:
            fire_fault_sync("offload_to_cpu")
        except FaultInjected:
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            functools.partial(trio.to_thread.run_sync, offload, abandon_on_cancel=True)
        )
        await _until_fired(fired)  # it fired after the release above...
        await trio.to_thread.run_sync(time.sleep, 0.3)  # ...and it still blocks
        assert not done.is_set()
        nursery.cancel_scope.cancel()
    release_hangs()
    assert await trio.to_thread.run_sync(done.wait, 10)


# --- child processes fire the same faults -------------------------------------------------

_CHILD = """
import sys
from trainer.vocabulary import fire_fault_sync
for step in (1, 2):
    print(f"step {step}", flush=True)
    fire_fault_sync("forward_backward", step=step)
print("not reached", flush=True)
"""


async def test_a_child_process_fires_the_faults_of_its_env_var():
    env = {**os.environ, FAULTS_ENV: "forward_backward:error=from child@2"}
    result = await trio.run_process(
        [sys.executable, "-c", _CHILD],
        cwd=ROOT,
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode != 0
    assert result.stdout.decode().split() == ["step", "1", "step", "2"]
    assert result.stderr.decode().strip().splitlines()[-1] == (
        "trainer.errors.FaultInjected: fault injected in 'forward_backward' at step 2: from child"
    )


async def test_an_installed_hang_really_hangs_a_worker_process_started_afterwards():
    install_faults("forward_backward:hang@2")  # exported: the child inherits it
    async with trio.open_nursery() as nursery:
        run_child = functools.partial(
            trio.run_process,
            [sys.executable, "-c", _CHILD],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            check=False,
        )
        proc = await nursery.start(run_child)
        seen = b""
        with trio.fail_after(60):
            while b"step 2" not in seen:
                chunk = await proc.stdout.receive_some()
                assert chunk, "the child exited before step 2"
                seen += chunk
        with (
            pytest.raises(StepTimeoutError) as info,
            step_deadline(2, 0.5),
            Timer("train_critic_and_policy"),
            operation("forward_backward"),
        ):
            await proc.wait()
        assert proc.returncode is None  # still hung when the deadline fired
        assert info.value.operation == "forward_backward"
        proc.kill()
    assert proc.returncode is not None


def test_a_fault_can_only_target_a_known_operation():
    with pytest.raises(ValueError, match="'backward'"):
        Fault("backward", FaultAction.HANG)


# --- faults that never fired --------------------------------------------------------------


async def test_a_fault_that_never_fired_here_or_in_a_child_is_reported(tmp_path):
    log = tmp_path / "faults_fired.log"
    install_faults("forward_backward:error=from child@2,optim_step:error=never@2", fired_log=log)
    assert [str(f) for f in unfired_faults()] == [
        "forward_backward:error=from child@2",
        "optim_step:error=never@2",
    ]
    # a step the fault does not name: nothing fired
    fire_fault_sync("forward_backward", step=1)
    assert len(unfired_faults()) == 2
    # the child inherits the spec and the log, fires at step 2 and dies of it
    result = await trio.run_process(
        [sys.executable, "-c", _CHILD], cwd=ROOT, capture_stdout=True, check=False
    )
    assert result.returncode != 0
    assert log.read_text() == "forward_backward:error=from child@2\n"
    assert [str(f) for f in unfired_faults()] == ["optim_step:error=never@2"]
    # firing here records it too; installing again starts over
    with pytest.raises(FaultInjected):
        fire_fault_sync("optim_step", step=2)
    assert unfired_faults() == []
    install_faults("optim_step:error=never@2", fired_log=log)
    assert log.read_text() == "" and len(unfired_faults()) == 1
