"""Typed errors (DESIGN 3 rule 8, 4.4): picklable with their fields, documented, pinned."""

from __future__ import annotations

import multiprocessing
import pickle
import re
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor

import pytest

import trainer.errors
from trainer.errors import (
    CheckpointEngineInitError,
    CheckpointError,
    ConfigError,
    DataError,
    EngineFailedError,
    EngineStartError,
    EngineUnusableError,
    FaultInjected,
    ForkServerError,
    InferenceServerError,
    InferenceServerTimeoutError,
    RayClusterStartError,
    RewardError,
    RolloutTimeoutError,
    StepTimeoutError,
    TrainerError,
    WeightSyncMismatchError,
    WeightSyncTimeoutError,
    WorkerError,
)

URL = "http://127.0.0.1:8001"

#: One builder per case; every class of trainer.errors has at least one (see the pin below).
#: Builders (not instances) so a child process can build and raise the same error.
CASES: dict[str, Callable[[], BaseException]] = {
    "step-timeout": lambda: StepTimeoutError(
        12, 1800, 1800.0, "train_critic_and_policy", "forward_backward"
    ),
    "weight-sync-timeout": lambda: WeightSyncTimeoutError(3, 15.0, 15.02, "sync_weights", "/pause"),
    "weight-sync-abandoned": lambda: WeightSyncTimeoutError(
        2, 20.0, 25.0, "sync_weights", "broadcast_to_inference_engines", "transfer abandoned"
    ),
    "step-timeout-no-stage": lambda: StepTimeoutError(1, 0.5, 0.51, None, "await"),
    "server-error": lambda: InferenceServerError(URL, "/pause", 503, "engine is sleeping"),
    "server-error-no-status": lambda: InferenceServerError(
        URL, "/v1/completions", None, "malformed JSON body"
    ),
    "server-timeout": lambda: InferenceServerTimeoutError(URL, "/pause", 5),
    "engine-start": lambda: EngineStartError(URL, "exited with code 1", "OSError: port in use"),
    "fork-server": lambda: ForkServerError("/tmp/fs.sock", "cannot be reached (no such file)"),
    "engine-failed": lambda: EngineFailedError(1, URL, 3, 3, "exited (signal 9)", "Killed"),
    "engine-unusable": lambda: EngineUnusableError([URL], "the re-send failed: boom", "segfault"),
    "sync-mismatch": lambda: WeightSyncMismatchError(URL, 3, 17, -3.6, -1.8, 1e-3, 2),
    "group-init": lambda: CheckpointEngineInitError("weight_sync", 600),
    "checkpoint": lambda: CheckpointError(
        "runs/x/checkpoints/global_step_4: manifest.json is missing"
    ),
    "worker": lambda: WorkerError("policy", 0, "train_critic_and_policy", "CUDA out of memory"),
    "fault": lambda: FaultInjected("forward_backward", "boom", 2),
    "fault-no-step": lambda: FaultInjected("/pause", "boom"),
    "config": lambda: ConfigError("trainer.step_timeout_s must be > 0, got -1"),
    "data": lambda: DataError("data/train.jsonl:3: missing field 'prompt'"),
    "ray-start": lambda: RayClusterStartError(None, 2, ["node timed out", "again"]),
    "root": lambda: TrainerError("raised by a plugin of ours"),
    "rollout-timeout": lambda: RolloutTimeoutError(3, (0, 17), 3, 8.0, "generate", "env_step"),
    "reward": lambda: RewardError("my_rewards:judge", 3, 2, "7 7", "7", "timed out after 5s"),
}


def _value(v: object) -> object:
    """Exceptions compare by identity: a nested one by type and args."""
    return (type(v), v.args) if isinstance(v, BaseException) else v


def _state(exc: BaseException) -> tuple[object, ...]:
    fields = {k: _value(v) for k, v in vars(exc).items()}
    return type(exc), tuple(map(_value, exc.args)), fields, str(exc)


def _raise_in_child(case: str) -> None:
    """Runs in a spawned process: build the error, annotate it there, raise it."""
    exc = CASES[case]()
    exc.add_note(f"raised in a child process ({case})")
    raise exc


def test_every_error_class_has_a_case():
    classes = {type(build()).__name__ for build in CASES.values()}
    assert classes == set(trainer.errors.__all__)


@pytest.mark.parametrize("case", CASES)
def test_pickle_round_trips_fields_message_and_notes(case):
    exc = CASES[case]()
    exc.add_note("while syncing weights to http://127.0.0.1:8001")
    back = pickle.loads(pickle.dumps(exc))
    assert back is not exc
    assert _state(back) == _state(exc)
    assert back.__notes__ == ["while syncing weights to http://127.0.0.1:8001"]


@pytest.fixture(scope="module")
def child_process():
    # spawn, not fork: the child shares nothing with this process but what pickle carries.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


@pytest.mark.parametrize("case", CASES)
def test_error_raised_in_another_process_arrives_intact(child_process, case):
    future = child_process.submit(_raise_in_child, case)
    expected = CASES[case]()
    with pytest.raises(type(expected)) as info:
        future.result(timeout=120)
    got = info.value
    assert type(got) is type(expected)
    assert _state(got)[1] == _state(expected)[1]
    assert str(got) == str(expected)
    fields = {k: _value(v) for k, v in vars(got).items() if k != "__notes__"}
    assert fields == _state(expected)[2]
    assert got.__notes__ == [f"raised in a child process ({case})"]


def test_step_timeout_message_has_the_documented_form():
    assert str(CASES["step-timeout"]()) == (
        "step 12 exceeded its 1800s budget after 1800.0s "
        "(stage='train_critic_and_policy', operation='forward_backward')"
    )
    assert str(CASES["weight-sync-timeout"]()) == (
        "step 3 exceeded its 15s budget after 15.0s (stage='sync_weights', operation='/pause')"
    )


def test_step_timeout_is_not_a_timeout_error():
    assert not issubclass(StepTimeoutError, TimeoutError)
    assert issubclass(WeightSyncTimeoutError, StepTimeoutError)
    assert issubclass(StepTimeoutError, RuntimeError)

    # A retry path that catches TimeoutError must not swallow a step's deadline.
    def transport_with_retry() -> None:
        try:
            raise CASES["weight-sync-timeout"]()
        except TimeoutError:
            pytest.fail("a retry path swallowed the step deadline")

    with pytest.raises(WeightSyncTimeoutError):
        transport_with_retry()


def test_server_errors_name_url_endpoint_and_status():
    assert (
        str(CASES["server-error"]()) == f"/pause on {URL} failed (status 503): engine is sleeping"
    )
    assert "no status" in str(CASES["server-error-no-status"]())
    timeout = CASES["server-timeout"]()
    assert isinstance(timeout, InferenceServerError)
    assert not isinstance(timeout, TimeoutError)
    assert (timeout.url, timeout.endpoint, timeout.status, timeout.timeout_s) == (
        URL,
        "/pause",
        None,
        5,
    )
    for part in (URL, "/pause", "5s", "engine.control_plane_timeout_s"):
        assert part in str(timeout)


def test_group_init_error_names_group_timeout_and_how_to_raise_it():
    message = str(CASES["group-init"]())
    for part in (
        "'weight_sync'",
        "600s",
        "sync.group_init_timeout_s",
        "TRAINER_GROUP_INIT_TIMEOUT_S",
    ):
        assert part in message


def test_rollout_timeout_names_prompt_step_attempts_bound_and_the_key_to_raise():
    error = CASES["rollout-timeout"]()
    assert str(error) == (
        "the rollout of prompt (epoch 0, position 17) for step 3 ran past its 8s bound 3 times "
        "in a row (stage='generate', operation='env_step'); if rollouts are slow but healthy, "
        "raise generator.rollout_timeout_s (unset, it is trainer.step_timeout_s)"
    )
    assert not isinstance(error, TimeoutError | StepTimeoutError)


def test_reward_error_names_the_function_the_limit_and_one_failing_sample():
    msg = str(CASES["reward"]())
    for part in ("'my_rewards:judge'", "3 times", "data.max_reward_failures=2", "'7 7'", "5s"):
        assert part in msg


def test_fault_injected_names_operation_and_step():
    assert str(CASES["fault"]()) == "fault injected in 'forward_backward' at step 2: boom"
    assert str(CASES["fault-no-step"]()) == "fault injected in '/pause': boom"


def test_public_api_is_pinned():
    assert sorted(trainer.errors.__all__) == [
        "CheckpointEngineInitError",
        "CheckpointError",
        "ConfigError",
        "DataError",
        "EngineFailedError",
        "EngineStartError",
        "EngineUnusableError",
        "FaultInjected",
        "ForkServerError",
        "InferenceServerError",
        "InferenceServerTimeoutError",
        "RayClusterStartError",
        "RewardError",
        "RolloutTimeoutError",
        "StepTimeoutError",
        "TrainerError",
        "WeightSyncMismatchError",
        "WeightSyncTimeoutError",
        "WorkerError",
    ]
    # Every exception class the module defines is public.
    defined = {
        name
        for name, obj in vars(trainer.errors).items()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == "trainer.errors"
    }
    assert defined == set(trainer.errors.__all__)


def _documented_tree() -> dict[str, str]:
    """``{class: parent}`` read from the hierarchy drawn in the module docstring."""
    doc = trainer.errors.__doc__ or ""
    tree = doc.split("Hierarchy::", 1)[1]
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in tree.splitlines():
        m = re.match(r"^([\s│├└─]*?)(\w+)\b", line)
        if not m or not m.group(2)[0].isupper():
            if stack and line.strip() and not line.startswith(" "):
                break  # prose after the drawing
            continue
        column, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= column:
            stack.pop()
        if stack:
            parents[name] = stack[-1][1]
        stack.append((column, name))
    return parents


def test_module_docstring_draws_every_class_under_its_real_parent():
    tree = _documented_tree()
    for name in trainer.errors.__all__:
        cls = getattr(trainer.errors, name)
        assert name in tree, f"{name} is missing from the hierarchy in the docstring"
        assert tree[name] == cls.__base__.__name__, f"{name} is drawn under the wrong parent"
        assert cls.__doc__, f"{name} has no docstring"


@pytest.mark.parametrize("case", CASES)
def test_every_error_is_a_trainer_error_and_keeps_its_builtin_base(case):
    exc = CASES[case]()
    assert isinstance(exc, TrainerError)
    if type(exc) is not TrainerError:  # what `except RuntimeError/ValueError` caught, it still does
        expected = ValueError if case in ("config", "data") else RuntimeError
        assert isinstance(exc, expected)
        if type(exc).__base__ is TrainerError:  # the docstring's drawing names the builtin base
            assert f"({expected.__name__})" in _drawn_line(type(exc))


def _drawn_line(cls: type) -> str:
    doc = trainer.errors.__doc__ or ""
    return next(line for line in doc.splitlines() if re.search(rf"[─ ]{cls.__name__}\b", line))
