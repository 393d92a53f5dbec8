"""What the reference engine keeps of a request, and the errors its data plane raises."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import trio

from engines.local.decode import KVRef
from engines.local.lora import Adapter
from engines.types import FinishReason, PromptLogprob, SamplingParams

__all__ = [
    "ENGINE_DEAD_MESSAGE",
    "EngineAsleepError",
    "EngineDeadError",
    "Request",
    "TokenCallback",
]

#: Called on the event loop with each sampled token: ``(token id, logprob, alternatives)``.
#: It must not block or raise (a streaming server puts it on a channel).
TokenCallback = Callable[[int, float, list[tuple[int, float]]], None]


class EngineAsleepError(RuntimeError):
    """A generation was asked of an engine whose weights are offloaded (``/sleep``)."""


#: vLLM's ``EngineDeadError`` message, which its server answers (500) once its engine died.
ENGINE_DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


class EngineDeadError(RuntimeError):
    """The engine died (it ran a decode step on partial weights, as vLLM's worker crashes)."""

    def __init__(self) -> None:
        super().__init__(ENGINE_DEAD_MESSAGE)


@attrs.define(eq=False)
class Request:
    """One request in the engine: its prompt, sampler, what it produced, its KV cache."""

    prompt_ids: list[int]
    params: SamplingParams
    #: The request's own sampler state (seeded by ``params.seed``).
    generator: torch.Generator
    out_ids: list[int] = attrs.field(factory=list)
    out_logprobs: list[float] = attrs.field(factory=list)
    out_top: list[list[tuple[int, float]]] = attrs.field(factory=list)
    #: Set when the engine died with the request in it.
    error: BaseException | None = None
    on_token: TokenCallback | None = None
    stop_reason: int | str | None = None
    #: KV cache of ``prompt_ids + out_ids[:-1]``; None until prefilled (or after a drop).
    kv: KVRef | None = None
    finish_reason: FinishReason | None = None
    done: trio.Event = attrs.field(factory=trio.Event)
    #: The LoRA adapter the request samples through (its ``model``); None: the base weights.
    adapter: Adapter | None = None
    #: Round the logits to bfloat16 before sampling and logprobs (the ``bf16_logits`` fault).
    bf16_logits: bool = False
    #: Its prompt's logprobs (``params.prompt_logprobs``), once its first prefill computed them.
    prompt_scores: list[PromptLogprob | None] | None = None

    def finish(self, reason: FinishReason) -> None:
        self.finish_reason = reason
        self.done.set()
