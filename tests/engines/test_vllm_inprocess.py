"""engines.vllm_inprocess against vLLM: its own classes where importable, its recorded shapes elsewhere.

Where ``import vllm`` works, the conversions run on vLLM's own ``SamplingParams``,
``RequestOutput``, ``CompletionOutput`` and ``Logprob``. Everywhere (CI included) they also run
against ``reference/vllm_shapes.json``, written from vLLM by ``reference/dump_vllm_shapes.py``:
stand-ins carry exactly the recorded attributes, so a field vLLM renames fails here once the
file is regenerated, and on a machine with vLLM a stale file fails
``test_the_recorded_shapes_are_those_of_the_installed_vllm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import pickle
import runpy
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
import trio

from engines import vllm_inprocess
from engines.bridge import open_bridge
from engines.control_plane import (
    CONTROL_PLANE_TIMEOUT_ENV,
    DEFAULT_CONTROL_PLANE_TIMEOUT_S,
    digests_checksum,
)
from engines.routes import (
    DATA_PLANE_ROUTES,
    PAUSE_ROUTES,
    ROUTE_FLAGS,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
)
from engines.types import SamplingParams
from engines.vllm_control import PROBE_METHODS, VLLM_URL, load_vllm_classes
from engines.vllm_inprocess import VLLMInProcessEngine
from engines.vllm_start import (
    DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S,
    ENGINE_ARG_FLAGS,
    engine_argv,
    open_async_llm,
)
from engines.weight_transfer import ipc_update_info, pickle_ipc_handles
from tests.engines.vllm_stand_in import StandInAsyncLLM, recorded_classes
from trainer.errors import (
    ConfigError,
    EngineStartError,
    FaultInjected,
    InferenceServerError,
    InferenceServerTimeoutError,
)
from trainer.vocabulary import install_faults

REFERENCE = Path(__file__).parent / "reference"
SHAPES: dict[str, Any] = json.loads((REFERENCE / "vllm_shapes.json").read_text())
SAMPLING_FIELDS: dict[str, dict[str, Any]] = SHAPES["SamplingParams"]["fields"]

needs_vllm = pytest.mark.skipif(not vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is not installed")
needs_no_vllm = pytest.mark.skipif(vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is installed here")

PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, max_tokens=32, seed=5, stop_token_ids=(2, 3), ignore_eos=True
)


class OutputClasses(NamedTuple):
    """The three classes a final ``generate`` result is made of."""

    request_output: Any
    completion_output: Any
    logprob: Any


def _stand_in(name: str) -> type:
    """A slotted class with exactly vLLM's recorded attributes (keyword-only; the recorded
    required ones without a default), so reading or passing any other name fails."""
    shape = SHAPES[name]
    fields: list[Any] = [
        (a, Any) if a in shape["required"] else (a, Any, dataclasses.field(default=None))
        for a in shape["attributes"]
    ]
    return dataclasses.make_dataclass(name, fields, kw_only=True, slots=True)


def _recorded_classes() -> OutputClasses:
    return OutputClasses(
        _stand_in("RequestOutput"), _stand_in("CompletionOutput"), _stand_in("Logprob")
    )


def _vllm_classes() -> OutputClasses:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    return OutputClasses(RequestOutput, CompletionOutput, Logprob)


@pytest.fixture(
    params=[
        pytest.param(_recorded_classes, id="recorded-shapes"),
        pytest.param(_vllm_classes, id="vllm", marks=needs_vllm),
    ]
)
def classes(request: pytest.FixtureRequest) -> OutputClasses:
    return request.param()


def _final_output(classes: OutputClasses, finish_reason: str | None) -> Any:
    """What ``AsyncLLM.generate`` yields last for prompt [1, 2] and sampled tokens [7, 8]: per
    token, a ``{token_id: Logprob}`` dict that holds the sampled token (here, for token 8,
    also a likelier token 9 that was not sampled)."""
    lp = classes.logprob
    sample = classes.completion_output(
        index=0,
        text="",
        token_ids=[7, 8],
        cumulative_logprob=-2.0,
        logprobs=[
            {7: lp(logprob=-0.5, rank=1)},
            {8: lp(logprob=-1.5, rank=2), 9: lp(logprob=-0.1, rank=1)},
        ],
        finish_reason=finish_reason,
    )
    return classes.request_output(
        request_id="traj-1",
        prompt=None,
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[sample],
        finished=finish_reason is not None,
    )


def test_sampling_params_convert_to_vllm_keywords() -> None:
    kwargs = vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)
    assert set(kwargs) <= set(SAMPLING_FIELDS), f"not fields of vLLM {SHAPES['vllm_version']}"
    assert kwargs == {
        "n": 1,  # one sample per request: a trajectory is one completion
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "seed": 5,
        "stop_token_ids": [2, 3],  # vLLM's field is a list[int]
        "ignore_eos": True,
        "logprobs": 0,  # no alternatives: vLLM adds the sampled token's own logprob
    }


def test_default_sampling_params_sample_like_vllms_defaults() -> None:
    kwargs = vllm_inprocess.to_vllm_sampling_kwargs(SamplingParams())
    for name in ("n", "temperature", "top_p", "max_tokens", "seed", "ignore_eos"):
        assert kwargs[name] == SAMPLING_FIELDS[name]["default"], name
    # vLLM's None (no extra stop tokens) is stored as an empty list
    assert kwargs["stop_token_ids"] == []
    assert SAMPLING_FIELDS["stop_token_ids"]["default"] is None


def test_logprobs_zero_returns_only_the_sampled_tokens_logprob() -> None:
    doc = " ".join(SAMPLING_FIELDS["logprobs"]["doc"].split())
    assert "always return the log probability of the sampled token" in doc
    assert "up to `logprobs+1` elements" in doc
    assert vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)["logprobs"] == 0


def test_the_last_streamed_output_holds_the_whole_completion() -> None:
    # generate() keeps the last RequestOutput: right for CUMULATIVE (vLLM's default) and
    # FINAL_ONLY, wrong for DELTA, which would keep only the last tokens
    assert "output_kind" not in vllm_inprocess.to_vllm_sampling_kwargs(PARAMS)
    assert "CUMULATIVE" in SAMPLING_FIELDS["output_kind"]["default"]


@needs_vllm
def test_with_vllm_the_keywords_build_its_sampling_params() -> None:
    import vllm
    from vllm.sampling_params import RequestOutputKind

    built = vllm.SamplingParams(**vllm_inprocess.to_vllm_sampling_kwargs(PARAMS))
    assert (built.n, built.temperature, built.top_p, built.max_tokens, built.seed) == (
        1,
        0.7,
        0.9,
        32,
        5,
    )
    assert (built.stop_token_ids, built.ignore_eos, built.logprobs) == ([2, 3], True, 0)
    assert built.output_kind is RequestOutputKind.CUMULATIVE


def test_a_request_output_converts_to_a_completion(classes: OutputClasses) -> None:
    c = vllm_inprocess.completion_from_output(_final_output(classes, "length"))
    assert (c.token_ids, c.logprobs, c.finish_reason, c.prompt_token_ids) == (
        [7, 8],
        [-0.5, -1.5],
        "length",
        [1, 2],
    )
    assert vllm_inprocess.completion_from_output(_final_output(classes, "stop")).finish_reason == (
        "stop"
    )


def test_n_samples_convert_in_vllms_index_order(classes: OutputClasses) -> None:
    assert vllm_inprocess.to_vllm_sampling_kwargs(PARAMS, 4)["n"] == 4
    output = _final_output(classes, "length")
    second = classes.completion_output(
        index=1,
        text="",
        token_ids=[4],
        cumulative_logprob=-0.25,
        logprobs=[{4: classes.logprob(logprob=-0.25, rank=1)}],
        finish_reason="stop",
    )
    output.outputs = [second, *output.outputs]  # vLLM yields children as they finish
    completions = vllm_inprocess.completions_from_output(output)
    assert [(c.token_ids, c.finish_reason) for c in completions] == [
        ([7, 8], "length"),
        ([4], "stop"),
    ]
    assert completions[1].logprobs == [-0.25]


@pytest.mark.parametrize("reason", ["abort", None])
def test_an_aborted_or_unfinished_output_converts_as_abort(
    classes: OutputClasses, reason: str | None
) -> None:
    completion = vllm_inprocess.completion_from_output(_final_output(classes, reason))
    assert completion.finish_reason == "abort"


def test_the_recorded_stand_ins_reject_names_vllm_does_not_have() -> None:
    classes = _recorded_classes()
    with pytest.raises(TypeError):
        classes.logprob(logprob=-0.5, prob=0.6)
    with pytest.raises(AttributeError):
        _ = classes.logprob(logprob=-0.5).prob


@needs_vllm
def test_the_recorded_shapes_are_those_of_the_installed_vllm() -> None:
    dump = runpy.run_path(str(REFERENCE / "dump_vllm_shapes.py"))
    installed = json.loads(json.dumps(dump["vllm_shapes"]()))
    assert installed == SHAPES, (
        f"vLLM {installed['vllm_version']} differs from the recorded {SHAPES['vllm_version']}: "
        "run tests/engines/reference/dump_vllm_shapes.py and review the diff"
    )


# -- the engine on the real bridge, against a stand-in AsyncLLM with the recorded signatures --


@pytest.fixture(autouse=True)
def _no_timeout_override(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tests set ``control_plane_timeout_s`` themselves: the environment must not win."""
    monkeypatch.delenv(CONTROL_PLANE_TIMEOUT_ENV, raising=False)


@asynccontextmanager
async def open_stand_in_engine(
    timeout_s: float | None = 60.0, **llm_kwargs: Any
) -> AsyncIterator[tuple[VLLMInProcessEngine, StandInAsyncLLM]]:
    """The engine on a real trio-asyncio bridge, driving a fresh stand-in ``AsyncLLM``."""
    llm = StandInAsyncLLM(**llm_kwargs)
    async with open_bridge() as bridge:
        engine = VLLMInProcessEngine(
            bridge, llm, recorded_classes(), control_plane_timeout_s=timeout_s
        )
        yield engine, llm


def _recorded_signature(method: str) -> inspect.Signature:
    params = SHAPES["AsyncLLM"]["methods"][method]
    return inspect.Signature(
        [
            inspect.Parameter(
                name,
                getattr(inspect.Parameter, p["kind"]),
                default=p.get("default", inspect.Parameter.empty),
            )
            for name, p in params.items()
        ]
    )


@pytest.mark.parametrize("method", sorted(SHAPES["AsyncLLM"]["methods"]))
def test_the_stand_in_has_the_recorded_signatures(method: str) -> None:
    ours = inspect.signature(getattr(StandInAsyncLLM, method))
    params = [p for name, p in ours.parameters.items() if name != "self"]
    plain = inspect.Signature([p.replace(annotation=inspect.Parameter.empty) for p in params])
    assert plain == _recorded_signature(method)


def test_every_asyncllm_method_the_routes_call_is_recorded_and_stood_in() -> None:
    called = {m for methods in PROBE_METHODS.values() for m in methods}
    assert called <= set(SHAPES["AsyncLLM"]["methods"])
    assert set(SHAPES["AsyncLLM"]["methods"]) == {
        name for name in vars(StandInAsyncLLM) if not name.startswith("_")
    }
    # the probe knows every route engines.routes knows (so ControlPlane's callers work)
    assert set(PROBE_METHODS) == set(ROUTE_FLAGS) | {"/weight_checker"}


def test_the_probes_config_attributes_are_vllms() -> None:
    assert "weight_transfer_config" in SHAPES["VllmConfig"]["attributes"]
    assert "enable_sleep_mode" in SHAPES["ModelConfig"]["attributes"]


INIT_INFO = {"master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 2}
UPDATE_INFO = {"names": ["w"], "dtype_names": ["float32"], "shapes": [[2, 2]]}
#: (method, path, params, json) -> (the AsyncLLM call, its arguments), as vLLM 0.33.0's routes make it.
ROUTE_CASES = [
    (("POST", "/pause", {"mode": "keep"}, None), ("pause_generation", {"mode": "keep", "clear_cache": True})),
    (("POST", "/pause", None, None), ("pause_generation", {"mode": "abort", "clear_cache": True})),
    (("POST", "/pause", {"mode": "wait", "clear_cache": "false"}, None), ("pause_generation", {"mode": "wait", "clear_cache": False})),
    (("POST", "/resume", None, None), ("resume_generation", {})),
    (("GET", "/is_paused", None, None), ("is_paused", {})),
    (("POST", "/sleep", {"level": 2}, None), ("sleep", {"level": 2, "mode": "abort"})),
    (("POST", "/sleep", {"level": "1", "mode": "keep"}, None), ("sleep", {"level": 1, "mode": "keep"})),
    (("POST", "/wake_up", None, None), ("wake_up", {"tags": None})),
    (("POST", "/wake_up", {"tags": ["weights"]}, None), ("wake_up", {"tags": ["weights"]})),
    (("GET", "/is_sleeping", None, None), ("is_sleeping", {})),
    (("POST", "/reset_prefix_cache", None, None), ("reset_prefix_cache", {"reset_running_requests": False, "reset_connector": False})),
    (("POST", "/reset_prefix_cache", {"reset_external": "true"}, None), ("reset_prefix_cache", {"reset_running_requests": False, "reset_connector": True})),
    (("POST", "/start_weight_update", None, {}), ("start_weight_update", {})),
    (("POST", "/finish_weight_update", None, {}), ("finish_weight_update", {"weight_version": None})),
    (("POST", "/finish_weight_update", None, {"weight_version": "v3"}), ("finish_weight_update", {"weight_version": "v3"})),
    (("POST", "/weight_checker", None, {"action": "checksum"}), ("compute_weight_checksums", {})),
]  # fmt: skip


@pytest.mark.parametrize(("request_", "expected"), ROUTE_CASES, ids=lambda v: str(v[1])[:40])
async def test_each_route_calls_the_asyncllm_method_vllms_route_calls(
    request_: tuple[str, str, Any, Any], expected: tuple[str, dict[str, Any]]
) -> None:
    method, path, params, body = request_
    async with open_stand_in_engine() as (engine, llm):
        llm.results["compute_weight_checksums"] = [{"a": "1"}]
        (answer,) = await engine.control(method, path, params=params, json=body)
    assert llm.calls == [expected]
    assert isinstance(answer, dict)


async def test_init_wraps_the_body_in_vllms_init_request() -> None:
    async with open_stand_in_engine() as (engine, llm):
        await engine.control_one(
            VLLM_URL, "POST", "/init_weight_transfer_engine", json={"init_info": INIT_INFO}
        )
    ((name, arguments),) = llm.calls
    assert name == "init_weight_transfer_engine"
    request = arguments["request"]
    assert type(request).__name__ == "WeightTransferInitRequest"
    assert request.init_info == INIT_INFO


async def test_an_ipc_update_with_pickled_handles_reaches_vllm_unchanged() -> None:
    """vLLM's worker decodes ``ipc_handles_pickled`` (IPCWeightTransferUpdateInfo.__post_init__):
    the engine passes the transport's body through, as vLLM's HTTP route does."""
    tensor = torch.zeros(2, 2)
    update_info = ipc_update_info([("w", tensor)], [16], pickle_ipc_handles({"gpu-0": ("h",)}))
    async with open_stand_in_engine() as (engine, llm):
        await engine.control("POST", "/update_weights", json={"update_info": update_info})
        await engine.control("POST", "/update_weights", json={"update_info": UPDATE_INFO})
    requests = [arguments["request"] for name, arguments in llm.calls]
    assert [type(r).__name__ for r in requests] == ["WeightTransferUpdateRequest"] * 2
    assert requests[0].update_info == update_info
    assert isinstance(requests[0].update_info["ipc_handles_pickled"], str)
    assert requests[1].update_info == UPDATE_INFO


async def test_the_named_calls_are_controlplanes_routes() -> None:
    async with open_stand_in_engine() as (engine, llm):
        llm.results.update(
            is_paused=True, is_sleeping=False, wake_up=True, reset_prefix_cache=True,
            compute_weight_checksums=[{"b": "2"}, {"a": "1"}],
        )  # fmt: skip
        await engine.pause("keep")
        await engine.sleep(1)
        await engine.sleep(1, mode="wait")
        await engine.wake_up(["weights"])
        await engine.wake_up()
        await engine.reset_prefix_cache()
        await engine.resume()
        assert await engine.is_paused() == [True]
        assert await engine.is_sleeping() == [False]
        assert await engine.weight_checksums() == [digests_checksum({"a": "1", "b": "2"})]
    assert [name for name, _ in llm.calls] == [
        "pause_generation", "sleep", "sleep", "wake_up", "wake_up", "reset_prefix_cache",
        "resume_generation", "is_paused", "is_sleeping", "compute_weight_checksums",
    ]  # fmt: skip
    assert llm.calls[2] == ("sleep", {"level": 1, "mode": "wait"})
    assert llm.calls[4] == ("wake_up", {"tags": None})
    assert engine.urls == ["inprocess://vllm"]


async def test_an_unknown_route_or_method_is_refused_naming_it() -> None:
    async with open_stand_in_engine() as (engine, llm):
        with pytest.raises(InferenceServerError) as unknown:
            await engine.control("POST", "/update_weight", json={})
        with pytest.raises(InferenceServerError) as wrong_method:
            await engine.control("GET", "/pause")
        with pytest.raises(ValueError, match="not this engine"):
            await engine.control_one("http://127.0.0.1:8000", "POST", "/resume")
    assert (unknown.value.endpoint, unknown.value.status) == ("/update_weight", 404)
    assert "/update_weight " in str(unknown.value) and "/update_weights" in str(unknown.value)
    assert wrong_method.value.status == 405
    assert llm.calls == []


async def test_a_bad_body_is_refused_before_vllm_is_called() -> None:
    async with open_stand_in_engine() as (engine, llm):
        with pytest.raises(InferenceServerError, match="init_info") as info:
            await engine.control("POST", "/init_weight_transfer_engine", json={"info": {}})
    assert info.value.endpoint == "/init_weight_transfer_engine"
    assert llm.calls == []


async def test_a_hung_vllm_call_ends_with_a_picklable_timeout_naming_the_route() -> None:
    async with open_stand_in_engine(timeout_s=0.5) as (engine, llm):
        llm.hang.add("start_weight_update")
        t0 = trio.current_time()
        with pytest.raises(InferenceServerTimeoutError) as info:
            await engine.control("POST", "/start_weight_update", json={})
        elapsed = trio.current_time() - t0
        assert llm.cancelled == ["start_weight_update"]  # the asyncio task was cancelled
    error = info.value
    assert (error.url, error.endpoint, error.timeout_s) == (VLLM_URL, "/start_weight_update", 0.5)
    assert "/start_weight_update on inprocess://vllm did not answer within 0.5s" in str(error)
    assert 0.5 <= elapsed < 60  # the bound fired, not something else; the machine is noisy
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is InferenceServerTimeoutError and str(copy) == str(error)


async def test_the_timeout_resolves_like_controlplanes(monkeypatch: pytest.MonkeyPatch) -> None:
    async with open_stand_in_engine(timeout_s=None) as (engine, _):
        assert engine.control_plane_timeout_s == DEFAULT_CONTROL_PLANE_TIMEOUT_S
    async with open_stand_in_engine(timeout_s=0) as (engine, _):
        assert engine.control_plane_timeout_s is None
    monkeypatch.setenv(CONTROL_PLANE_TIMEOUT_ENV, "7")
    async with open_stand_in_engine(timeout_s=0) as (engine, _):
        assert engine.control_plane_timeout_s == 7.0


async def test_a_vllm_exception_becomes_an_inference_server_error_naming_the_route() -> None:
    async with open_stand_in_engine() as (engine, llm):
        llm.fail["update_weights"] = RuntimeError("NCCL error: unhandled system error")
        with pytest.raises(InferenceServerError) as info:
            await engine.control("POST", "/update_weights", json={"update_info": UPDATE_INFO})
    error = info.value
    assert type(error) is InferenceServerError
    assert (error.url, error.endpoint) == (VLLM_URL, "/update_weights")
    assert "RuntimeError: NCCL error" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


async def test_a_trio_cancellation_cancels_the_asyncio_task() -> None:
    async with open_stand_in_engine(timeout_s=None) as (engine, llm):
        llm.hang.add("pause_generation")
        with trio.move_on_after(0.3) as scope:
            await engine.pause("keep")
        # the trio caller leaves only once the asyncio task has unwound
        assert scope.cancelled_caught
        assert llm.cancelled == ["pause_generation"]
        llm.hang.clear()
        await engine.resume()  # the engine still works
    assert [name for name, _ in llm.calls] == ["pause_generation", "resume_generation"]


async def test_a_cancelled_generate_cancels_the_vllm_request() -> None:
    async with open_stand_in_engine() as (engine, llm):
        llm.hang.add("generate")
        with trio.move_on_after(0.3) as scope:
            await engine.generate([1, 2], PARAMS, trajectory_id="traj-1")
        assert scope.cancelled_caught
        assert llm.cancelled == ["generate"]
    ((name, arguments),) = llm.calls
    assert name == "generate"
    assert arguments["prompt"] == {"prompt_token_ids": [1, 2]}
    assert arguments["request_id"].startswith("traj-1-")
    assert arguments["sampling_params"].max_tokens == PARAMS.max_tokens


async def test_generate_n_returns_the_final_outputs_completions() -> None:
    classes = _recorded_classes()
    async with open_stand_in_engine() as (engine, llm):
        llm.results["generate"] = [_final_output(classes, None), _final_output(classes, "length")]
        completions = await engine.generate_n([1, 2], PARAMS, 1)
    assert [(c.token_ids, c.finish_reason) for c in completions] == [([7, 8], "length")]
    assert llm.calls[0][1]["sampling_params"].n == 1


async def test_a_hang_fault_fires_inside_the_routes_operation() -> None:
    install_faults("/start_weight_update:hang")
    async with open_stand_in_engine(timeout_s=0.3) as (engine, llm):
        with pytest.raises(InferenceServerTimeoutError) as info:
            await engine.control("POST", "/start_weight_update", json={})
    assert info.value.endpoint == "/start_weight_update"
    assert llm.calls == []  # the fault hung where the call runs, before vLLM


async def test_an_error_fault_names_its_operation() -> None:
    install_faults("/pause:error=boom")
    async with open_stand_in_engine() as (engine, llm):
        with pytest.raises(FaultInjected) as info:
            await engine.pause("keep")
        await engine.reset_prefix_cache()  # not an operation: no fault hook, no ValueError
    assert info.value.operation == "/pause"
    assert [name for name, _ in llm.calls] == ["reset_prefix_cache"]


async def test_probe_names_missing_methods_and_settings() -> None:
    async with open_stand_in_engine() as (engine, _):
        await engine.probe((*DATA_PLANE_ROUTES, *PAUSE_ROUTES, *WEIGHT_TRANSFER_ROUTES))
        with pytest.raises(ValueError, match="/v1/chat"):
            await engine.probe(["/v1/chat"])
    async with open_stand_in_engine(enable_sleep_mode=False, weight_transfer=False) as (engine, _):
        await engine.probe()  # pause and data plane need neither
        with pytest.raises(InferenceServerError, match="enable_sleep_mode") as sleep:
            await engine.probe(SLEEP_ROUTES)
        with pytest.raises(InferenceServerError, match="weight_transfer_backend"):
            await engine.probe(WEIGHT_TRANSFER_ROUTES)
        engine.llm = object()  # an AsyncLLM without the methods (an older vLLM)
        with pytest.raises(InferenceServerError, match="is_paused") as missing:
            await engine.probe()
    assert sleep.value.status == missing.value.status == 404


# -- the engine's flags: vllm serve's, as recorded from vLLM's add_cli_args ---------------------

ENGINE_ARGS = SHAPES["AsyncEngineArgs"]


def test_the_flags_the_engine_sets_are_vllms() -> None:
    recorded = {field: tuple(entry["flags"]) for field, entry in ENGINE_ARGS["cli"].items()}
    assert recorded == dict(ENGINE_ARG_FLAGS)
    assert set(ENGINE_ARGS["fields"]) == set(ENGINE_ARG_FLAGS)


def _parse_like_vllm(argv: list[str]) -> argparse.Namespace:
    """A parser with the recorded flags and defaults of the fields the engine sets (vLLM's own
    parser needs a device to build; it runs where vLLM does)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    for field, entry in ENGINE_ARGS["cli"].items():
        default = ENGINE_ARGS["fields"][field]["default"]
        kind = {"tensor_parallel_size": int, "seed": int, "gpu_memory_utilization": float}
        if field == "enable_sleep_mode":  # vLLM's bool fields: BooleanOptionalAction
            parser.add_argument(
                *entry["flags"], dest=field, default=default, action=argparse.BooleanOptionalAction
            )
        elif field == "weight_transfer_config":
            parser.add_argument(*entry["flags"], dest=field, default=default, type=json.loads)
        else:
            parser.add_argument(
                *entry["flags"], dest=field, default=default, type=kind.get(field, str)
            )
    namespace, rest = parser.parse_known_args(argv)
    namespace.rest = rest
    return namespace  # fmt: skip


def test_engine_argv_sets_each_field_by_its_vllm_flag() -> None:
    argv = engine_argv(
        "/models/qwen",
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        seed=7,
        enable_sleep_mode=True,
        weight_transfer_backend="ipc",
        extra_args=["--max-model-len", "4096"],
    )
    parsed = _parse_like_vllm(argv)
    assert (parsed.model, parsed.tensor_parallel_size, parsed.gpu_memory_utilization) == (
        "/models/qwen",
        2,
        0.5,
    )
    assert (parsed.seed, parsed.enable_sleep_mode) == (7, True)
    assert parsed.weight_transfer_config == {"backend": "ipc"}
    assert parsed.rest == ["--max-model-len", "4096"]  # left to vLLM's parser


def test_engine_argv_defaults_are_vllms_where_it_sets_none() -> None:
    parsed = _parse_like_vllm(engine_argv("m", weight_transfer_backend=None))
    defaults = {f: e["default"] for f, e in ENGINE_ARGS["fields"].items()}
    assert parsed.gpu_memory_utilization == defaults["gpu_memory_utilization"]
    assert parsed.enable_sleep_mode is defaults["enable_sleep_mode"] is False
    assert parsed.weight_transfer_config is defaults["weight_transfer_config"] is None


@pytest.mark.parametrize(
    "extra", [["--seed", "3"], ["--tensor_parallel_size=2"], ["-tp", "2"], ["--no-enable-sleep-mode"], ["--weight-transfer-config.backend=ipc"]]
)  # fmt: skip
def test_extra_args_may_not_set_what_the_engine_sets(extra: list[str]) -> None:
    with pytest.raises(ValueError, match="the engine's own settings") as info:
        engine_argv("m", extra_args=extra)
    field = next(f for f, flags in ENGINE_ARG_FLAGS.items() if f in str(info.value))
    assert field in ENGINE_ARG_FLAGS


# -- start and stop: in a thread, bounded, always shut down -------------------------------------


@needs_no_vllm
async def test_without_vllm_the_opener_says_in_one_line_what_to_install() -> None:
    t0 = trio.current_time()
    with pytest.raises(ConfigError) as info:
        async with vllm_inprocess.open_vllm_inprocess_client("any", extra_args=["--seed", "1"]):
            pytest.fail("opened vLLM without vLLM")
    message = str(info.value)
    assert "\n" not in message
    assert "pip install vllm" in message and "engine.backend=vllm_inprocess" in message
    assert trio.current_time() - t0 < 30  # at once: no import, no thread, no bridge


async def test_a_failed_build_is_an_engine_start_error_with_the_reason() -> None:
    def build() -> Any:
        raise ValueError("vLLM's engine arguments refused ['--max-model-len', 'x']")

    with pytest.raises(EngineStartError, match="refused") as info:
        async with open_async_llm(build, startup_timeout_s=60):
            pytest.fail("started")
    assert info.value.url == VLLM_URL


async def test_the_engine_is_shut_down_on_every_exit() -> None:
    llm = StandInAsyncLLM()
    with trio.move_on_after(0.2):  # a cancellation (a deadline) ends the block
        async with open_async_llm(lambda: (llm, recorded_classes()), shutdown_timeout_s=5):
            await trio.sleep_forever()
    assert llm.calls == [("shutdown", {"timeout": 5})]
    other = StandInAsyncLLM()
    with pytest.raises(KeyError):
        async with open_async_llm(lambda: (other, recorded_classes())):
            raise KeyError("the body failed")
    assert other.shut_down.is_set()


async def test_a_build_past_its_timeout_fails_and_what_it_builds_later_is_shut_down() -> None:
    release = threading.Event()
    llm = StandInAsyncLLM()

    def slow_build() -> Any:
        release.wait(60)  # a real blocked thread: the model still loading
        return llm, recorded_classes()

    with pytest.raises(EngineStartError, match=r"did not start within 0.3s"):
        async with open_async_llm(slow_build, startup_timeout_s=0.3):
            pytest.fail("started")
    assert not llm.shut_down.is_set()
    release.set()
    await trio.to_thread.run_sync(llm.shut_down.wait, 60)
    assert llm.calls == [("shutdown", {"timeout": DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S})]


@needs_vllm
def test_with_vllm_the_classes_and_the_parser_the_engine_uses_import() -> None:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    classes = load_vllm_classes()
    assert classes.init_request(init_info={"packed": True}).init_info == {"packed": True}
    assert classes.update_request(update_info=UPDATE_INFO).update_info == UPDATE_INFO
    assert callable(AsyncLLM.from_engine_args) and callable(FlexibleArgumentParser)
