"""Fault injection (DESIGN 4.5): the spec, which faults are active, and when a fault fires
(what each action does: test_fault_actions.py)."""

from __future__ import annotations

import os

import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.errors import ConfigError, FaultInjected
from trainer.vocabulary import (
    FAULTS_ENV,
    OPERATIONS,
    Fault,
    FaultAction,
    Faults,
    active_faults,
    fire_fault,
    fire_fault_sync,
    install_faults,
    parse_faults,
    step_deadline,
)


def test_operations_are_those_of_design_4_3():
    # plus issue 17's wait_for_batch (fully-async's wait for a batch of rollouts) and issue
    # 28's two points inside a transfer (fired on the trainer's side, so against real vLLM),
    # and issue 61's teacher_logprobs (a distillation teacher's scoring of one sequence)
    assert OPERATIONS == (
        "generate",
        "env_step",
        "teacher_logprobs",
        "forward",
        "forward_backward",
        "optim_step",
        # issue 44: the critic's calls
        "critic_forward",
        "critic_forward_backward",
        "critic_optim_step",
        "offload_to_cpu",
        "backload_to_gpu",
        "broadcast_to_inference_engines",
        "transfer_after_first_bucket",
        "transfer_before_finish",
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
        # issue 61: a LoRA adapter's sync (sync.lora=adapter)
        "/v1/load_lora_adapter",
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
            "write OP:ACTION[@STEPS], ACTION one of hang, sleep=S, delay=S, error=MSG, kill_engine=I, stop_engine=I, "
            "or at their one operation stale, drop_bucket, bf16_logits or skip_load",
        ),
        (
            "forward_backward:hung@2",
            "faults: unknown action 'hung' in 'forward_backward:hung@2'; "
            "ACTION is one of hang, sleep=S, delay=S, error=MSG, kill_engine=I, stop_engine=I, "
            "or at their one operation stale, drop_bucket, bf16_logits or skip_load",
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
