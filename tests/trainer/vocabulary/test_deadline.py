"""Deadlines (DESIGN 3, rules 3-6): arithmetic under trio's MockClock, hangs with real threads
(rule 7, cleanup with what is left of the budget: test_cleanup_budget.py)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import pytest
import trio
import trio.testing

from trainer.errors import StepTimeoutError, WeightSyncTimeoutError
from trainer.vocabulary import (
    Timer,
    bounded,
    current_operation,
    current_stage,
    current_step,
    operation,
    remaining,
    stage,
    step_deadline,
    wait_result,
)

# --- nested deadlines ------------------------------------------------------------------


async def test_inner_shorter_deadline_raises_its_own_class_and_the_step_goes_on(autojump_clock):
    start = trio.current_time()
    with step_deadline(7, 100):
        with (
            pytest.raises(WeightSyncTimeoutError) as info,
            step_deadline(7, 10, WeightSyncTimeoutError),
            Timer("sync_weights"),
            operation("/pause"),
        ):
            await trio.sleep_forever()
        # The step's own budget still runs: 90 s of it are left.
        assert remaining() == pytest.approx(90)
    err = info.value
    assert type(err) is WeightSyncTimeoutError
    assert (err.step, err.budget_s, err.stage, err.operation) == (7, 10, "sync_weights", "/pause")
    assert err.elapsed_s == pytest.approx(10)
    assert trio.current_time() - start == pytest.approx(10)


@pytest.mark.parametrize("inner_budget", [50, 10], ids=["parent-shorter", "equal"])
async def test_parent_deadline_first_or_tied_keeps_the_parents_class_and_budget(
    autojump_clock, inner_budget
):
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(3, 10),
        Timer("sync_weights"),
        step_deadline(3, inner_budget, WeightSyncTimeoutError),
        operation("broadcast_to_inference_engines"),
    ):
        await trio.sleep_forever()
    err = info.value
    assert type(err) is StepTimeoutError
    assert (err.step, err.budget_s) == (3, 10)
    assert err.elapsed_s == pytest.approx(10)
    assert (err.stage, err.operation) == ("sync_weights", "broadcast_to_inference_engines")


async def test_none_budget_is_a_noop_that_still_names_the_step(autojump_clock):
    start = trio.current_time()
    with step_deadline(5, None):
        assert current_step() == 5
        assert remaining() is None
        await trio.sleep(10**6)
    assert trio.current_time() - start == pytest.approx(10**6)
    assert current_step() is None


async def test_none_budget_inside_a_deadline_leaves_the_parent_in_effect(autojump_clock):
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(1, 20),
        step_deadline(1, None, WeightSyncTimeoutError),
    ):
        assert remaining() == pytest.approx(20)
        await trio.sleep_forever()
    assert type(info.value) is StepTimeoutError
    assert info.value.budget_s == 20


async def test_error_message_has_the_exact_documented_form(autojump_clock):
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(12, 1800),
        Timer("train_critic_and_policy"),
        operation("forward_backward"),
    ):
        await trio.sleep_forever()
    assert str(info.value) == (
        "step 12 exceeded its 1800s budget after 1800.0s "
        "(stage='train_critic_and_policy', operation='forward_backward')"
    )


# --- stage and operation name the hang ---------------------------------------------------


async def test_expiry_names_the_innermost_open_stage_and_operation(autojump_clock):
    with pytest.raises(StepTimeoutError) as info, step_deadline(2, 60), stage("sync_weights"):
        with operation("/pause"):
            await trio.sleep(1)
        with stage("eval"), operation("/update_weights"):
            await trio.sleep_forever()
    assert (info.value.stage, info.value.operation) == ("eval", "/update_weights")


@pytest.mark.parametrize(
    ("enter", "name"),
    [(stage, "train_policy"), (operation, "forward_bakcward"), (Timer, "sync")],
)
def test_a_stage_or_operation_outside_the_vocabulary_is_refused(enter, name):
    with pytest.raises(ValueError, match=repr(name)):
        with enter(name):
            pass


def test_any_control_plane_path_is_an_operation():
    with operation("/is_paused"):  # every endpoint is named by its path (DESIGN 4.3)
        assert current_operation() == "/is_paused"


async def test_expiry_with_no_operation_open_names_await(autojump_clock):
    with pytest.raises(StepTimeoutError) as info, step_deadline(2, 60), Timer("generate"):
        with operation("generate"):
            await trio.sleep(1)  # finished: it must not be blamed
        await trio.sleep_forever()
    assert (info.value.stage, info.value.operation) == ("generate", "await")


async def test_expiry_outside_any_stage_names_no_stage_and_await(autojump_clock):
    with pytest.raises(StepTimeoutError) as info, step_deadline(2, 60):
        await trio.sleep_forever()
    assert (info.value.stage, info.value.operation) == (None, "await")


async def test_expiry_in_a_nursery_child_names_the_childs_operation(autojump_clock):
    async def rollout() -> None:
        with operation("env_step"):
            await trio.sleep_forever()

    with pytest.raises(StepTimeoutError) as info, step_deadline(4, 30), Timer("generate"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollout)
    assert (info.value.stage, info.value.operation) == ("generate", "env_step")


async def test_bounded_cuts_its_block_off_and_names_where_a_child_waited(autojump_clock):
    async def rollout() -> None:
        with operation("env_step"):
            await trio.sleep_forever()

    with bounded(5) as bound, stage("generate"):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rollout)
    assert bound.expired and bound.elapsed_s == pytest.approx(5)
    assert bound.hit_at == ("generate", "env_step")
    assert trio.current_time() == pytest.approx(5)  # and the code after it runs on


async def test_bounded_with_none_or_a_block_that_finishes_in_time_is_not_expired(autojump_clock):
    with bounded(None) as unbounded:
        await trio.sleep(10_000)
    with bounded(5) as bound, operation("generate"):
        await trio.sleep(4)
    assert not unbounded.expired and not bound.expired and bound.hit_at is None


async def test_a_step_deadline_before_a_bound_raises_the_steps_error(autojump_clock):
    with pytest.raises(StepTimeoutError) as info, step_deadline(2, 3):
        with bounded(5) as bound, stage("generate"), operation("env_step"):
            await trio.sleep_forever()
    assert not bound.expired
    assert (info.value.stage, info.value.operation) == ("generate", "env_step")


async def test_stage_and_operation_are_restored_on_exit():
    with stage("generate"), operation("generate"):
        assert (current_stage(), current_operation()) == ("generate", "generate")
        with stage("eval"), operation("env_step"):
            assert (current_stage(), current_operation()) == ("eval", "env_step")
        assert (current_stage(), current_operation()) == ("generate", "generate")
    assert (current_stage(), current_operation()) == (None, None)


def _block_the_loop_for(seconds: float) -> None:
    """Spend real wall time on the trio thread (the mock clock does not move)."""
    time.sleep(seconds)


async def test_timer_records_its_stage_and_seconds_even_when_the_block_raises():
    timings: dict[str, float] = {}
    with (
        pytest.raises(ValueError, match="bad reward"),
        Timer("compute_advantages", timings) as timer,
    ):
        assert current_stage() == "compute_advantages"
        _block_the_loop_for(0.02)  # wall time the timer must count
        raise ValueError("bad reward")
    assert current_stage() is None
    assert timings == {"compute_advantages": timer.elapsed_s}
    assert timer.elapsed_s >= 0.02


async def test_timer_records_its_seconds_when_the_deadline_cuts_it_off(autojump_clock):
    timings: dict[str, float] = {}
    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(1, 5),
        Timer("fwd_logprobs_values_reward", timings) as timer,
    ):
        _block_the_loop_for(0.02)  # wall time the timer must count
        await trio.sleep_forever()
    assert info.value.stage == "fwd_logprobs_values_reward"
    assert timings == {"fwd_logprobs_values_reward": timer.elapsed_s}
    # wall seconds (perf_counter), not the 5 s the mock clock jumped
    assert 0.02 <= timer.elapsed_s < 5


# Tests with threads run on the real clock (or mock_clock, which stands still): an
# autojump clock would jump to the deadline while the loop waits for the thread.


async def test_threads_see_the_step_stage_operation_and_remaining_budget():
    def in_worker() -> tuple[object, ...]:
        return current_step(), current_stage(), current_operation(), remaining()

    with step_deadline(9, 600), Timer("train_critic_and_policy"), operation("forward_backward"):
        step, stage_name, op, left = await trio.to_thread.run_sync(in_worker)
    assert (step, stage_name, op) == (9, "train_critic_and_policy", "forward_backward")
    # Threads measure with time.monotonic from the deadline's start: bounded by the budget.
    assert left is not None and 0 < left <= 600


async def test_an_error_raised_inside_an_operation_in_a_thread_passes_through():
    # Regression: unwinding an operation() in a worker thread under a deadline once read
    # trio's clock from the thread and replaced the error with a RuntimeError.
    def worker() -> None:
        with operation("forward_backward"):
            raise ValueError("loss is nan")

    with pytest.raises(ValueError, match="loss is nan"), step_deadline(1, 60):
        await trio.to_thread.run_sync(worker)


# --- remote waits use the remaining budget ------------------------------------------------


async def test_wait_result_passes_exactly_the_remaining_budget(mock_clock):
    # mock_clock stands still unless jumped, so a thread cannot make time pass.
    with step_deadline(1, 30):
        mock_clock.jump(12)
        assert await wait_result(lambda timeout: timeout) == 18.0
        with step_deadline(1, 5, WeightSyncTimeoutError):
            mock_clock.jump(1)
            assert await wait_result(lambda timeout: timeout) == 4.0


async def test_wait_result_without_a_deadline_waits_unbounded():
    assert await wait_result(lambda timeout: timeout) is None


async def test_wait_result_turns_the_callees_timeout_into_the_deadlines_error(mock_clock):
    def ray_get(timeout: float | None) -> object:
        raise TimeoutError(f"Get timed out: some object(s) not ready after {timeout}s")

    with (
        pytest.raises(StepTimeoutError) as info,
        step_deadline(5, 60),
        Timer("fwd_logprobs_values_reward"),
        operation("forward"),
    ):
        await wait_result(ray_get)
    err = info.value
    assert type(err) is StepTimeoutError
    assert (err.step, err.budget_s) == (5, 60)
    assert (err.stage, err.operation) == ("fwd_logprobs_values_reward", "forward")
    assert isinstance(err.__cause__, TimeoutError)
    assert "after 60.0s" in str(err.__cause__)


async def test_wait_result_reports_the_effective_inner_deadline(mock_clock):
    def get(timeout: float | None) -> object:
        raise TimeoutError

    with (
        step_deadline(2, 600),
        pytest.raises(WeightSyncTimeoutError) as info,
        step_deadline(2, 15, WeightSyncTimeoutError),
        Timer("sync_weights"),
        operation("broadcast_to_inference_engines"),
    ):
        await wait_result(get)
    assert info.value.budget_s == 15
    assert info.value.operation == "broadcast_to_inference_engines"


async def test_wait_result_with_no_operation_open_names_await(mock_clock):
    def get(timeout: float | None) -> object:
        raise TimeoutError

    with pytest.raises(StepTimeoutError) as info, step_deadline(2, 600), Timer("generate"):
        await wait_result(get)
    assert (info.value.stage, info.value.operation) == ("generate", "await")


async def test_a_timeout_error_not_from_wait_result_passes_through_unchanged(autojump_clock):
    original = TimeoutError("connect to reward server timed out")
    with (
        pytest.raises(TimeoutError) as info,
        step_deadline(1, 60),
        Timer("generate"),
        operation("env_step"),
    ):
        await trio.sleep(1)
        raise original
    assert info.value is original


async def test_wait_result_without_a_deadline_passes_a_timeout_error_through():
    original = TimeoutError("library timeout")

    def get(timeout: float | None) -> object:
        raise original

    with pytest.raises(TimeoutError) as info:
        await wait_result(get)
    assert info.value is original


# --- a really blocked thread (real clock) -------------------------------------------------


async def test_a_really_blocked_worker_thread_times_out_naming_backload_to_gpu():
    blocked = threading.Event()  # never set while the step waits: the thread is really stuck
    exited = threading.Event()

    def backload_to_gpu() -> None:
        try:
            blocked.wait()
        finally:
            exited.set()

    t0 = time.monotonic()
    try:
        with (
            pytest.raises(StepTimeoutError) as info,
            step_deadline(3, 0.5),
            Timer("sync_weights"),
            operation("backload_to_gpu"),
        ):
            await trio.to_thread.run_sync(backload_to_gpu, abandon_on_cancel=True)
        waited = time.monotonic() - t0
        # The driver's wait was interrupted; the worker is still stuck.
        assert not exited.is_set()
    finally:
        blocked.set()
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
    assert await trio.to_thread.run_sync(exited.wait, 10)


async def test_a_future_that_never_resolves_times_out_through_wait_result():
    blocked = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        future = pool.submit(blocked.wait)
        try:
            with (
                pytest.raises(StepTimeoutError) as info,
                step_deadline(6, 0.5),
                Timer("sync_weights"),
                operation("backload_to_gpu"),
            ):
                await wait_result(future.result)
        finally:
            blocked.set()
    assert (info.value.step, info.value.operation) == (6, "backload_to_gpu")
    assert 0.5 <= info.value.elapsed_s < 10
