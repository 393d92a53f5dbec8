"""Fault injection (DESIGN 4.5): the spec, when a fault fires, and what each action really does."""

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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.errors import ConfigError, FaultInjected, StepTimeoutError
from trainer.vocabulary import (
    FAULTS_ENV,
    OPERATIONS,
    Fault,
    FaultAction,
    Faults,
    Timer,
    active_faults,
    fire_fault,
    fire_fault_sync,
    install_faults,
    operation,
    parse_faults,
    release_hangs,
    step_deadline,
    unfired_faults,
)

ROOT = Path(__file__).resolve().parents[2]


def test_operations_are_those_of_design_4_3():
    # plus issue 17's wait_for_batch (fully-async's wait for a batch of rollouts)
    assert OPERATIONS == (
        "generate",
        "env_step",
        "forward",
        "forward_backward",
        "optim_step",
        "offload_to_cpu",
        "backload_to_gpu",
        "broadcast_to_inference_engines",
        "init_process_group",
        "save_checkpoint",
        "wait_for_batch",
        "/pause",
        "/resume",
        "/sleep",
        "/wake_up",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        # issue 11: vLLM keeps prefix caches across a keep-mode pause; reset after a transfer
        "/reset_prefix_cache",
    )


# --- the spec ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", ()),
        ("  ", ()),
        ("forward_backward:hang@2", (Fault("forward_backward", FaultAction.HANG, steps=(2, 2)),)),
        (
            "broadcast_to_inference_engines:sleep=5@2",
            (
                Fault(
                    "broadcast_to_inference_engines", FaultAction.SLEEP, seconds=5.0, steps=(2, 2)
                ),
            ),
        ),
        (
            "/pause:delay=0.25@1-4",
            (Fault("/pause", FaultAction.DELAY, seconds=0.25, steps=(1, 4)),),
        ),
        (
            "generate:error=engine fell over",
            (Fault("generate", FaultAction.ERROR, message="engine fell over"),),
        ),
        # The last '@' starts STEPS, so a message may contain one.
        (
            "/resume:error=a@b@3",
            (Fault("/resume", FaultAction.ERROR, message="a@b", steps=(3, 3)),),
        ),
        (
            " forward:hang@0 , optim_step:delay=1 ,",
            (
                Fault("forward", FaultAction.HANG, steps=(0, 0)),
                Fault("optim_step", FaultAction.DELAY, seconds=1.0),
            ),
        ),
    ],
)
def test_valid_specs_parse_to_faults(spec, expected):
    assert parse_faults(spec) == expected


OPS_LIST = ", ".join(OPERATIONS)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "forward_backwards:hang",
            "faults: unknown operation 'forward_backwards' in 'forward_backwards:hang'; "
            f"did you mean 'forward_backward'? operations: {OPS_LIST}",
        ),
        (
            "pause:hang",
            f"faults: unknown operation 'pause' in 'pause:hang'; did you mean '/pause'? operations: {OPS_LIST}",
        ),
        (
            "train:hang",
            f"faults: unknown operation 'train' in 'train:hang'; operations: {OPS_LIST}",
        ),
        (
            "forward_backward",
            "faults: no action in 'forward_backward'; "
            "write OP:ACTION[@STEPS], ACTION one of hang, sleep=S, delay=S or error=MSG",
        ),
        (
            "forward_backward:hung@2",
            "faults: unknown action 'hung' in 'forward_backward:hung@2'; "
            "ACTION is one of hang, sleep=S, delay=S or error=MSG",
        ),
        (
            "forward_backward:sleep",
            "faults: 'sleep' in 'forward_backward:sleep'; sleep needs seconds >= 0, e.g. sleep=5",
        ),
        (
            "/pause:delay=-1",
            "faults: 'delay=-1' in '/pause:delay=-1'; delay needs seconds >= 0, e.g. delay=5",
        ),
        (
            "/pause:delay=soon",
            "faults: 'delay=soon' in '/pause:delay=soon'; delay needs seconds >= 0, e.g. delay=5",
        ),
        (
            "/pause:hang=3",
            "faults: 'hang=3' in '/pause:hang=3'; hang takes no value",
        ),
        (
            "generate:error=",
            "faults: 'error' without a message in 'generate:error='; write error=MSG, e.g. error=boom",
        ),
        (
            "forward_backward:hang@3-2",
            "faults: bad steps '3-2' in 'forward_backward:hang@3-2'; STEPS is N or N-M with N <= M",
        ),
        (
            "forward_backward:hang@two",
            "faults: bad steps 'two' in 'forward_backward:hang@two'; STEPS is N or N-M with N <= M",
        ),
        (
            "generate:hang,forward_backward:hang@-1",
            "faults: bad steps '-1' in 'forward_backward:hang@-1'; STEPS is N or N-M with N <= M",
        ),
    ],
)
def test_invalid_specs_raise_a_one_line_config_error(spec, message):
    with pytest.raises(ConfigError) as info:
        parse_faults(spec)
    assert str(info.value) == message
    assert "\n" not in str(info.value)


_ops = st.sampled_from(OPERATIONS)
_steps = st.tuples(st.integers(0, 50), st.integers(0, 50)).map(lambda t: (min(t), max(t)))
_seconds = st.floats(0, 1e4).map(lambda s: float(f"{s:g}"))
# Messages the grammar can write: no ',' and, unless STEPS follows, no '@'.
_faults = (
    st.builds(Fault, _ops, st.just(FaultAction.HANG), steps=st.none() | _steps)
    | st.builds(
        Fault,
        _ops,
        st.sampled_from([FaultAction.SLEEP, FaultAction.DELAY]),
        seconds=_seconds,
        steps=st.none() | _steps,
    )
    | st.builds(
        Fault,
        _ops,
        st.just(FaultAction.ERROR),
        message=st.text("abc =:-_/xyz", min_size=1).filter(lambda m: m.strip() == m),
    )
    | st.builds(
        Fault,
        _ops,
        st.just(FaultAction.ERROR),
        message=st.text("abc @=:-_/xyz", min_size=1).filter(lambda m: m.strip() == m),
        steps=_steps,
    )
)


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_faults, max_size=4))
def test_the_canonical_spec_parses_back_to_the_same_faults(entries):
    parsed = Faults(tuple(entries))
    assert Faults.parse(parsed.spec) == parsed


@pytest.mark.parametrize(
    ("steps", "step", "fires"),
    [
        (None, None, True),
        (None, 7, True),
        ((2, 2), 2, True),
        ((2, 2), 1, False),
        ((2, 2), 3, False),
        ((2, 4), 2, True),
        ((2, 4), 4, True),
        ((2, 4), 5, False),
        ((2, 4), None, False),  # a fault with STEPS needs the step to be known
    ],
)
def test_a_fault_applies_on_its_steps_only(steps, step, fires):
    assert Fault("forward", FaultAction.HANG, steps=steps).applies_to(step) is fires


def test_the_first_applicable_entry_for_an_operation_wins():
    fs = Faults.parse("forward:error=early@1-2,generate:hang,forward:error=late")
    assert fs.match("forward", 2) == Fault(
        "forward", FaultAction.ERROR, message="early", steps=(1, 2)
    )
    assert fs.match("forward", 3) == Fault("forward", FaultAction.ERROR, message="late")
    assert fs.match("optim_step", 3) is None


# --- which faults are active -------------------------------------------------------------


def test_install_makes_faults_active_and_exports_them_to_child_processes():
    installed = install_faults(" forward_backward:hang@2 ,/pause:delay=3")
    assert active_faults() == installed
    assert os.environ[FAULTS_ENV] == "forward_backward:hang@2,/pause:delay=3"
    install_faults("")
    assert not active_faults()
    assert FAULTS_ENV not in os.environ


def test_a_bad_spec_installs_nothing():
    install_faults("generate:error=boom")
    with pytest.raises(ConfigError):
        install_faults("generate:explode")
    assert active_faults().spec == "generate:error=boom"
    assert os.environ[FAULTS_ENV] == "generate:error=boom"


def test_the_env_var_is_read_when_nothing_was_installed():
    os.environ[FAULTS_ENV] = "optim_step:error=from env"
    install_faults(None)
    with pytest.raises(FaultInjected, match="from env"):
        fire_fault_sync("optim_step")
    # Installing wins over the environment.
    install_faults("")
    os.environ[FAULTS_ENV] = "optim_step:error=from env"
    fire_fault_sync("optim_step")


async def test_firing_with_no_fault_installed_does_nothing_and_never_checkpoints():
    install_faults("")
    with trio.testing.assert_no_checkpoints():
        for op in OPERATIONS:
            fire_fault_sync(op)
            await fire_fault(op)


async def test_firing_an_unknown_operation_is_a_caller_bug():
    with pytest.raises(ValueError, match="unknown operation 'backward'"):
        fire_fault_sync("backward")
    with pytest.raises(ValueError, match="unknown operation 'pause'"):
        await fire_fault("pause")


# --- error ------------------------------------------------------------------------------


async def test_error_raises_fault_injected_with_op_and_the_current_step():
    install_faults("forward_backward:error=loss exploded@2")
    # The worker thread inherits the step from the trio task's context.
    with step_deadline(2, None), pytest.raises(FaultInjected) as info:
        await trio.to_thread.run_sync(fire_fault_sync, "forward_backward")
    err = info.value
    assert (err.operation, err.message, err.step) == ("forward_backward", "loss exploded", 2)
    assert str(err) == "fault injected in 'forward_backward' at step 2: loss exploded"


async def test_a_fault_with_steps_fires_only_when_the_step_is_known_and_in_range():
    install_faults("/pause:error=no@2-3")
    await fire_fault("/pause")  # step unknown: no step_deadline open, none passed
    for step in (1, 4):
        with step_deadline(step, None):
            await fire_fault("/pause")
    with step_deadline(3, None), pytest.raises(FaultInjected) as info:
        await fire_fault("/pause")
    assert info.value.step == 3
    # An explicit step (a process that does not share the trainer's context) wins.
    with pytest.raises(FaultInjected) as info:
        fire_fault_sync("/pause", step=2)
    assert info.value.step == 2


async def test_a_fault_without_steps_fires_every_time_step_known_or_not():
    install_faults("env_step:error=tool crashed")
    with pytest.raises(FaultInjected) as info:
        await fire_fault("env_step")
    assert info.value.step is None
    with step_deadline(8, None), pytest.raises(FaultInjected) as info:
        fire_fault_sync("env_step")
    assert info.value.step == 8


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


async def test_hang_really_blocks_a_worker_thread_until_the_step_deadline_names_it():
    install_faults("backload_to_gpu:hang@3")
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
    assert not exited.is_set()

    release_hangs()  # test-only
    assert await trio.to_thread.run_sync(exited.wait, 10)
    assert len(outcome) == 1 and isinstance(outcome[0], FaultInjected)
    assert outcome[0].step == 3


async def test_a_hang_that_fires_after_a_release_blocks_again():
    install_faults("offload_to_cpu:hang")
    release_hangs()
    done = threading.Event()

    def offload() -> None:
        try:
            fire_fault_sync("offload_to_cpu")
        except FaultInjected:
            done.set()

    with trio.move_on_after(0.3):
        await trio.to_thread.run_sync(offload, abandon_on_cancel=True)
    assert not done.is_set()
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
