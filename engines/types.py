"""Values exchanged with an inference engine, whatever engine it is."""

from __future__ import annotations

from typing import Literal

import attrs

__all__ = ["Completion", "FinishReason", "SamplingParams"]

FinishReason = Literal["stop", "length", "abort"]


@attrs.frozen
class SamplingParams:
    """How to sample one completion (the subset of vLLM's ``SamplingParams`` we use)."""

    #: Softmax temperature; 0 means greedy.
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p``.
    top_p: float = 1.0
    #: Most tokens to generate.
    max_tokens: int = 16
    #: Per-request seed; the same seed, prompt and weights give the same tokens. None: random.
    seed: int | None = None
    #: Extra token ids that end the completion (included in the output, like EOS).
    stop_token_ids: tuple[int, ...] = ()
    #: Keep generating past EOS until ``max_tokens``.
    ignore_eos: bool = False


@attrs.frozen
class Completion:
    """One sampled completion."""

    #: Sampled token ids, including the stop token when ``finish_reason == "stop"``.
    token_ids: list[int]
    #: Log-probability of each sampled token under the model (raw logits, vLLM's default).
    logprobs: list[float]
    #: ``stop`` (EOS or a stop token), ``length`` (max_tokens) or ``abort`` (engine paused with abort).
    finish_reason: FinishReason
    #: The prompt the completion continues.
    prompt_token_ids: list[int] = attrs.field(factory=list)
