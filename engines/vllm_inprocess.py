"""``engine.backend=vllm``: vLLM's ``AsyncLLM`` inside the trainer's process, through the bridge.

::

    async with open_bridge() as bridge:
        async with open_vllm_inprocess(bridge, model="Qwen/Qwen2.5-0.5B", enable_sleep_mode=True) as engine:
            completion = await engine.generate(prompt_ids, SamplingParams(max_tokens=64))
            await engine.pause("keep")
            ...

Same ``generate`` signature as :class:`engines.client.InferenceClient`, and the control
plane the trainer uses (``pause``, ``resume``, ``sleep``, ``wake_up``, ``is_paused``,
``is_sleeping``, ``reset_prefix_cache``), each control call inside ``operation(path)``.
Every call runs as an asyncio task on the bridge's loop, so a trio cancellation (a step
deadline) cancels it, and ``AsyncLLM.generate`` aborts the request on cancellation.

Needs ``pip install vllm`` and a CUDA GPU. Importing this module works without vLLM (the
import is guarded); constructing an engine without it raises ``EngineStartError`` saying so.
Only the import guard and the parameter/output conversion are tested on CPU; the rest
follows vLLM's ``AsyncLLM`` API (see ``docs/engines.md``) and is unverified here.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager
from typing import Any, Literal

import trio

from engines.bridge import Bridge
from engines.types import Completion, FinishReason, SamplingParams
from trainer.errors import EngineStartError
from trainer.vocabulary import fire_fault, operation

__all__ = [
    "VLLM_AVAILABLE",
    "VLLMInProcessEngine",
    "completion_from_output",
    "completions_from_output",
    "open_vllm_inprocess",
    "require_vllm",
    "to_vllm_sampling_kwargs",
]

try:  # vLLM is optional: GPU machines only
    import vllm as _vllm
except ImportError as exc:  # pragma: no cover - depends on the machine
    _vllm = None
    _VLLM_IMPORT_ERROR: ImportError | None = exc
else:  # pragma: no cover
    _VLLM_IMPORT_ERROR = None

#: Whether ``import vllm`` worked in this process.
VLLM_AVAILABLE = _vllm is not None
_URL = "inprocess://vllm"


def require_vllm() -> Any:
    """The ``vllm`` module; ``EngineStartError`` naming ``pip install vllm`` and the GPU need if absent."""
    if _vllm is None:
        raise EngineStartError(
            _URL,
            "engine.backend=vllm needs vLLM, which is not installed here "
            f"({_VLLM_IMPORT_ERROR}); on a machine with a CUDA GPU run `pip install vllm`, "
            "or use engine.backend=local (CPU reference engine) or engine.backend=remote",
        )
    return _vllm


def to_vllm_sampling_kwargs(sampling: SamplingParams, n: int = 1) -> dict[str, Any]:
    """Keyword arguments of ``vllm.SamplingParams`` for our ``SamplingParams`` and ``n`` samples.

    Always asks for the sampled token's logprob (``logprobs=0``). ``output_kind`` stays vLLM's
    default (cumulative), so the last ``RequestOutput`` that ``generate`` yields holds the
    whole completion.
    """
    return {
        "n": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,
    }


def completion_from_output(output: Any) -> Completion:
    """Our ``Completion`` from a final ``vllm.RequestOutput`` (its first sample)."""
    return _sample_completion(output, output.outputs[0])


def completions_from_output(output: Any) -> list[Completion]:
    """Every sample of a final ``vllm.RequestOutput``, ordered by ``CompletionOutput.index``.

    Each sample's ``logprobs`` is one ``{token_id: Logprob}`` dict per sampled token; the
    sampled token's entry is taken. A finish reason other than stop/length (vLLM reports
    ``abort`` for aborted requests; None if unfinished) becomes ``abort``.
    """
    samples = sorted(output.outputs, key=lambda sample: int(sample.index))
    return [_sample_completion(output, sample) for sample in samples]


def _sample_completion(output: Any, sample: Any) -> Completion:
    token_ids = [int(t) for t in sample.token_ids]
    logprobs: list[float] = []
    for tok, entry in zip(token_ids, sample.logprobs or []):
        lp = entry[tok]
        logprobs.append(float(getattr(lp, "logprob", lp)))
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    reason = sample.finish_reason
    finish: FinishReason = reason if reason in ("stop", "length") else "abort"
    return Completion(token_ids, logprobs, finish, [int(t) for t in output.prompt_token_ids])


class VLLMInProcessEngine:
    """One ``AsyncLLM`` driven from trio; create with :func:`open_vllm_inprocess`."""

    def __init__(self, bridge: Bridge, llm: Any) -> None:
        require_vllm()
        self.bridge = bridge
        self.llm = llm
        self.urls = [_URL]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        """Sample one completion inside ``operation("generate")``, where its fault fires; a trio
        cancellation cancels (and so aborts) the vLLM request."""
        (completion,) = await self.generate_n(prompt_ids, sampling, 1, trajectory_id=trajectory_id)
        return completion

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        """``n`` completions as one vLLM request with ``n`` (vLLM seeds child ``i`` with
        ``seed + i``); in sample order. Cancellation as :meth:`generate`."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        vllm = require_vllm()
        params = vllm.SamplingParams(**to_vllm_sampling_kwargs(sampling, n))
        request_id = f"{trajectory_id or 'gen'}-{uuid.uuid4().hex}"

        async def final() -> Any:
            last = None
            async for out in self.llm.generate(
                {"prompt_token_ids": list(prompt_ids)}, params, request_id
            ):
                last = out
            return last

        with operation("generate"):
            await fire_fault("generate")
            return completions_from_output(await self.bridge.run(final))

    async def _control(self, path: str, method: str, *args: Any, **kwargs: Any) -> Any:
        with operation(path):
            return await self.bridge.run(getattr(self.llm, method), *args, **kwargs)

    async def pause(self, mode: Literal["keep", "abort", "wait"] = "keep") -> None:
        await self._control("/pause", "pause_generation", mode=mode)

    async def resume(self) -> None:
        await self._control("/resume", "resume_generation")

    async def is_paused(self) -> list[bool]:
        return [bool(await self._control("/is_paused", "is_paused"))]

    async def sleep(self, level: int = 1) -> None:
        await self._control("/sleep", "sleep", level)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        await self._control("/wake_up", "wake_up", list(tags) if tags else None)

    async def is_sleeping(self) -> list[bool]:
        return [bool(await self._control("/is_sleeping", "is_sleeping"))]

    async def reset_prefix_cache(self) -> None:
        await self._control("/reset_prefix_cache", "reset_prefix_cache")


@asynccontextmanager
async def open_vllm_inprocess(
    bridge: Bridge, model: str, **engine_args: Any
) -> AsyncIterator[VLLMInProcessEngine]:
    """Build an ``AsyncLLM`` (``AsyncEngineArgs(model=model, **engine_args)``) on the bridge's
    loop, yield it wrapped, and shut it down on exit. ``EngineStartError`` without vLLM."""
    require_vllm()
    from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found]

    args: Mapping[str, Any] = {"model": model, **engine_args}

    async def build() -> Any:
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    llm = await bridge.run(build)
    try:
        yield VLLMInProcessEngine(bridge, llm)
    finally:
        with trio.CancelScope(shield=True):  # joins vLLM's engine-core process: off the loop
            await trio.to_thread.run_sync(llm.shutdown)
