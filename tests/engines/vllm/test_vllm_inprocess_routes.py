"""engines.vllm.inprocess's control surface on the real trio-asyncio bridge, against a stand-in
``AsyncLLM`` whose methods have the signatures recorded from vLLM (``reference/vllm_shapes.json``):
each route calls the method vLLM's router calls, with its argument conversion, bounded and typed.
"""

from __future__ import annotations

import inspect
import pickle
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import pytest
import torch
import trio

from engines.bridge import open_bridge
from engines.client import (
    CONTROL_PLANE_TIMEOUT_ENV,
    DATA_PLANE_ROUTES,
    DEFAULT_CONTROL_PLANE_TIMEOUT_S,
    PAUSE_ROUTES,
    ROUTE_FLAGS,
    SLEEP_ROUTES,
    WEIGHT_TRANSFER_ROUTES,
    digests_checksum,
)
from engines.types import SamplingParams
from engines.vllm.control import PROBE_METHODS, VLLM_URL
from engines.vllm.inprocess import VLLMInProcessEngine
from engines.weight_transfer import ipc_update_info, pickle_ipc_handles
from tests.engines.vllm.stand_in import (
    SHAPES,
    StandInAsyncLLM,
    final_output,
    recorded_classes,
    recorded_output_classes,
)
from trainer.errors import (
    FaultInjected,
    InferenceServerError,
    InferenceServerTimeoutError,
)
from trainer.vocabulary import install_faults

PARAMS = SamplingParams(
    temperature=0.7, top_p=0.9, max_tokens=32, seed=5, stop_token_ids=(2, 3), ignore_eos=True
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
    # the probe knows every route engines.client.ROUTE_FLAGS knows (so ControlPlane's callers
    # work), the LoRA routes included (engines.vllm.lora)
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
    async with open_stand_in_engine(timeout_s=None) as (engine, _):
        assert engine.control_plane_timeout_s == 7.0  # unset: the environment's
    async with open_stand_in_engine(timeout_s=0) as (engine, _):
        assert engine.control_plane_timeout_s is None  # given: as given


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


async def _until_called(llm: StandInAsyncLLM, name: str) -> None:
    """Until the stand-in has been called ``name`` (it records a call as it starts)."""
    with trio.fail_after(60):
        while name not in [n for n, _ in llm.calls]:  # noqa: ASYNC110 - asyncio side
            await trio.sleep(0.01)


async def test_a_trio_cancellation_cancels_the_asyncio_task() -> None:
    async with open_stand_in_engine(timeout_s=None) as (engine, llm):
        llm.hang.add("pause_generation")
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(engine.pause, "keep")
                await _until_called(llm, "pause_generation")  # hung in asyncio
                scope.cancel()
        # the trio caller leaves only once the asyncio task has unwound
        assert scope.cancelled_caught
        assert llm.cancelled == ["pause_generation"]
        llm.hang.clear()
        await engine.resume()  # the engine still works
    assert [name for name, _ in llm.calls] == ["pause_generation", "resume_generation"]


async def test_a_cancelled_generate_cancels_the_vllm_request() -> None:
    async with open_stand_in_engine() as (engine, llm):
        llm.hang.add("generate")
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(engine.generate, [1, 2], PARAMS, trajectory_id="traj-1"))
                await _until_called(llm, "generate")  # hung in asyncio
                scope.cancel()
        assert scope.cancelled_caught
        assert llm.cancelled == ["generate"]
    ((name, arguments),) = llm.calls
    assert name == "generate"
    assert arguments["prompt"] == {"prompt_token_ids": [1, 2]}
    assert arguments["request_id"].startswith("traj-1-")
    assert arguments["sampling_params"].max_tokens == PARAMS.max_tokens


async def test_generate_n_returns_the_final_outputs_completions() -> None:
    classes = recorded_output_classes()
    async with open_stand_in_engine() as (engine, llm):
        llm.results["generate"] = [final_output(classes, None), final_output(classes, "length")]
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
