"""A stand-in for vLLM 0.33.0's ``AsyncLLM``, where vLLM cannot run (no GPU, or not installed).

Each method has the signature recorded from vLLM (``reference/vllm_shapes.json``;
``test_the_stand_in_has_the_recorded_signatures`` holds them equal), so a call vLLM would
refuse (a wrong name, a positional keyword-only argument) fails here too. A method records
its call, then returns ``results[name]``, raises ``fail[name]``, or, for a name in ``hang``,
waits forever on the asyncio loop it is called from (recording its ``CancelledError`` in
``cancelled``). The classes it is handed values of are stand-ins with vLLM's recorded fields.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from engines.vllm.control import VLLMClasses

SHAPES: dict[str, Any] = json.loads(
    (Path(__file__).parents[1] / "vllm_recorded" / "vllm_shapes.json").read_text()
)


def recorded_class(name: str) -> type:
    """A keyword-only dataclass with exactly the recorded attributes of ``SHAPES[name]``."""
    shape = SHAPES[name]
    fields: list[Any] = [
        (a, Any) if a in shape["required"] else (a, Any, dataclasses.field(default=None))
        for a in shape["attributes"]
    ]
    return dataclasses.make_dataclass(name, fields, kw_only=True, slots=True)


def recorded_sampling_params() -> type:
    """``SamplingParams`` with its recorded fields, each defaulting to None."""
    names = list(SHAPES["SamplingParams"]["fields"])
    fields: list[Any] = [(n, Any, dataclasses.field(default=None)) for n in names]
    return dataclasses.make_dataclass("SamplingParams", fields, kw_only=True, slots=True)


def recorded_classes() -> VLLMClasses:
    return VLLMClasses(
        sampling_params=recorded_sampling_params(),
        init_request=recorded_class("WeightTransferInitRequest"),
        update_request=recorded_class("WeightTransferUpdateRequest"),
        lora_request=recorded_class("LoRARequest"),
    )


class OutputClasses(NamedTuple):
    """The three classes a final ``generate`` result is made of."""

    request_output: Any
    completion_output: Any
    logprob: Any


def recorded_output_classes() -> OutputClasses:
    """``RequestOutput``, ``CompletionOutput`` and ``Logprob`` with their recorded attributes."""
    return OutputClasses(
        recorded_class("RequestOutput"),
        recorded_class("CompletionOutput"),
        recorded_class("Logprob"),
    )


def final_output(classes: OutputClasses, finish_reason: str | None) -> Any:
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


class StandInAsyncLLM:
    """``AsyncLLM``'s methods that the engine calls, with vLLM 0.33.0's signatures."""

    def __init__(
        self, *, enable_sleep_mode: bool = True, weight_transfer: bool = True, lora: bool = False
    ) -> None:
        #: ``(method, {argument: value})`` of every call, in order.
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.results: dict[str, Any] = {}
        self.fail: dict[str, BaseException] = {}
        self.hang: set[str] = set()
        #: Methods whose asyncio task was cancelled while it hung.
        self.cancelled: list[str] = []
        #: Set by ``shutdown`` (from whatever thread calls it).
        self.shut_down = threading.Event()
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=enable_sleep_mode),
            weight_transfer_config=SimpleNamespace(backend="nccl") if weight_transfer else None,
            lora_config=SimpleNamespace(max_lora_rank=8) if lora else None,
        )

    async def _called(self, name: str, **arguments: Any) -> Any:
        self.calls.append((name, arguments))
        if name in self.fail:
            raise self.fail[name]
        if name in self.hang:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.append(name)
                raise
        return self.results.get(name)

    @classmethod
    def from_engine_args(
        cls,
        engine_args: Any,
        start_engine_loop: Any = True,
        usage_context: Any = "ENGINE_CONTEXT",
        stat_loggers: Any = None,
    ) -> StandInAsyncLLM:
        return cls()

    async def generate(
        self,
        prompt: Any,
        sampling_params: Any,
        request_id: Any,
        *,
        prompt_text: Any = None,
        lora_request: Any = None,
        tokenization_kwargs: Any = None,
        trace_headers: Any = None,
        priority: Any = 0,
        data_parallel_rank: Any = None,
        session_id: Any = None,
        kv_hints: Any = None,
        reasoning_ended: Any = None,
        reasoning_parser_kwargs: Any = None,
    ) -> Any:
        outputs = await self._called(
            "generate",
            prompt=prompt,
            sampling_params=sampling_params,
            request_id=request_id,
            lora_request=lora_request,
        )
        for output in outputs or []:
            yield output

    async def check_health(self) -> Any:
        return await self._called("check_health")

    async def pause_generation(self, *, mode: Any = "abort", clear_cache: Any = True) -> Any:
        return await self._called("pause_generation", mode=mode, clear_cache=clear_cache)

    async def resume_generation(self) -> Any:
        return await self._called("resume_generation")

    async def is_paused(self) -> Any:
        return await self._called("is_paused")

    async def sleep(self, level: Any = 1, mode: Any = "abort") -> Any:
        return await self._called("sleep", level=level, mode=mode)

    async def wake_up(self, tags: Any = None) -> Any:
        return await self._called("wake_up", tags=tags)

    async def is_sleeping(self) -> Any:
        return await self._called("is_sleeping")

    async def reset_prefix_cache(
        self, reset_running_requests: Any = False, reset_connector: Any = False
    ) -> Any:
        return await self._called(
            "reset_prefix_cache",
            reset_running_requests=reset_running_requests,
            reset_connector=reset_connector,
        )

    async def init_weight_transfer_engine(self, request: Any) -> Any:
        return await self._called("init_weight_transfer_engine", request=request)

    async def start_weight_update(self) -> Any:
        return await self._called("start_weight_update")

    async def update_weights(self, request: Any) -> Any:
        return await self._called("update_weights", request=request)

    async def finish_weight_update(self, weight_version: Any = None) -> Any:
        return await self._called("finish_weight_update", weight_version=weight_version)

    async def add_lora(self, lora_request: Any) -> Any:
        return await self._called("add_lora", lora_request=lora_request)

    async def compute_weight_checksums(self) -> Any:
        return await self._called("compute_weight_checksums")

    def shutdown(self, timeout: Any = None) -> None:
        self.calls.append(("shutdown", {"timeout": timeout}))
        self.shut_down.set()
