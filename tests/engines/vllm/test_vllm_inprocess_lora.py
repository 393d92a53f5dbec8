"""engines.vllm.lora: the in-process vLLM engine serves LoRA adapters by name as ``vllm serve``
does (its checks, statuses, messages, ids), on the real trio-asyncio bridge against a stand-in
``AsyncLLM`` and ``LoRARequest`` with the signatures and fields recorded from vLLM 0.33.0. Real
vLLM loads and serves them in tests/engines/vllm/test_vllm_backend.py."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from engines.bridge import open_bridge
from engines.client import LORA_ROUTES
from engines.types import SamplingParams
from engines.vllm.inprocess import VLLMInProcessEngine
from tests.engines.vllm.stand_in import (
    StandInAsyncLLM,
    final_output,
    recorded_classes,
    recorded_output_classes,
)
from trainer.errors import InferenceServerError

BASE = "/models/base"
PARAMS = SamplingParams(temperature=1.0, max_tokens=2)


@asynccontextmanager
async def open_engine(
    model: str | None = "policy", lora: bool = True
) -> AsyncIterator[tuple[VLLMInProcessEngine, StandInAsyncLLM]]:
    llm = StandInAsyncLLM(lora=lora)
    llm.results["generate"] = [final_output(recorded_output_classes(), "length")]
    async with open_bridge() as bridge:
        yield (
            VLLMInProcessEngine(bridge, llm, recorded_classes(), model=model, base_model=BASE),
            llm,
        )


async def _load(engine: VLLMInProcessEngine, name: str, path: str, **extra: Any) -> Any:
    body = {"lora_name": name, "lora_path": path, **extra}
    (answer,) = await engine.control("POST", "/v1/load_lora_adapter", json=body)
    return answer


def _added(llm: StandInAsyncLLM) -> list[tuple[str, int, str, bool]]:
    return [
        (r.lora_name, r.lora_int_id, r.lora_path, r.load_inplace)
        for name, args in llm.calls
        if name == "add_lora"
        for r in [args["lora_request"]]
    ]


async def test_loads_keep_a_names_id_and_completions_go_through_the_latest() -> None:
    async with open_engine() as (engine, llm):
        assert await _load(engine, "policy", "/a/v1") == (
            "Success: LoRA adapter 'policy' added successfully."
        )
        with pytest.raises(InferenceServerError) as again:
            await _load(engine, "policy", "/a/v2")  # without load_inplace
        assert again.value.status == 400 and "set 'load_inplace' to True" in str(again.value)
        await _load(engine, "policy", "/a/v2", load_inplace=True)
        await _load(engine, "other", "/b/v1")
        await engine.generate([1, 2], PARAMS)
    assert _added(llm) == [
        ("policy", 1, "/a/v1", False),
        ("policy", 1, "/a/v2", True),  # in place: the name's id, vLLM replaces its weights
        ("other", 2, "/b/v1", False),
    ]
    (request,) = [args["lora_request"] for name, args in llm.calls if name == "generate"]
    assert (request.lora_name, request.lora_path) == ("policy", "/a/v2")


async def test_the_base_model_generates_without_an_adapter() -> None:
    for model in (None, BASE):
        async with open_engine(model=model) as (engine, llm):
            await engine.generate([1, 2], PARAMS)
        assert llm.calls[-1][1]["lora_request"] is None


async def test_an_unloaded_adapter_is_an_unknown_model_as_vllm_answers() -> None:
    async with open_engine() as (engine, llm):
        with pytest.raises(InferenceServerError) as before:
            await engine.generate([1, 2], PARAMS)  # nothing loaded yet
        await _load(engine, "policy", "/a/v1")
        (answer,) = await engine.control(
            "POST", "/v1/unload_lora_adapter", json={"lora_name": "policy"}
        )
        assert answer == "Success: LoRA adapter 'policy' removed successfully."
        with pytest.raises(InferenceServerError) as after:
            await engine.generate([1, 2], PARAMS)
        with pytest.raises(InferenceServerError) as unknown:
            await engine.control("POST", "/v1/unload_lora_adapter", json={"lora_name": "policy"})
    for err in (before, after):
        assert err.value.status == 404 and "The model `policy` does not exist." in str(err.value)
    assert unknown.value.status == 404
    assert "The lora adapter 'policy' cannot be found." in str(unknown.value)
    assert [name for name, _ in llm.calls] == ["add_lora"]  # no request reached vLLM


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        ({"lora_name": "", "lora_path": "/a"}, 400, "Both 'lora_name' and 'lora_path'"),
        ({"lora_name": BASE, "lora_path": "/a"}, 400, "conflicts with a served base model"),
        # as vLLM's request model answers (the reference server's words alike: lora_answers)
        ({"lora_path": "/a"}, 400, "'loc': 'body.lora_name', 'msg': 'Field required'"),
        ({"lora_name": "a", "lora_path": 3}, 400, "lora_path must be a string, got 3"),
    ],
)
async def test_loads_vllm_refuses_never_reach_it(body: dict, status: int, message: str) -> None:
    async with open_engine() as (engine, llm):
        with pytest.raises(InferenceServerError) as info:
            await engine.control("POST", "/v1/load_lora_adapter", json=body)
    assert info.value.status == status and message in str(info.value)
    assert info.value.endpoint == "/v1/load_lora_adapter"
    assert llm.calls == []


async def test_a_failed_load_keeps_the_previous_adapter_served() -> None:
    async with open_engine() as (engine, llm):
        await _load(engine, "policy", "/a/v1")
        llm.fail["add_lora"] = ValueError("LoRA rank 64 is greater than max_lora_rank 8")
        with pytest.raises(InferenceServerError) as info:
            await _load(engine, "policy", "/a/v2", load_inplace=True)
        del llm.fail["add_lora"]
        await engine.generate([1, 2], PARAMS)
    assert info.value.status == 500 and "greater than max_lora_rank" in str(info.value)
    assert isinstance(info.value.__cause__, ValueError)
    assert llm.calls[-1][1]["lora_request"].lora_path == "/a/v1"


async def test_the_lora_routes_need_an_engine_started_with_enable_lora() -> None:
    async with open_engine(lora=True) as (engine, _):
        await engine.probe(LORA_ROUTES)
    async with open_engine(lora=False) as (engine, _):
        with pytest.raises(InferenceServerError, match="--enable-lora") as info:
            await engine.probe(LORA_ROUTES)
    assert info.value.status == 404
