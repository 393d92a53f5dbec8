"""The public generator API (DESIGN 4.7): what a custom generator receives and returns."""

from __future__ import annotations

import abc
from collections.abc import Iterator, Sequence
from typing import Any

import attrs

from engines.types import EngineClient, SamplingParams
from trainer.data import RewardFn

__all__ = [
    "EngineClient",
    "Generator",
    "GeneratorInput",
    "GeneratorOutput",
    "Trajectory",
    "TrajectoryInput",
]


@attrs.frozen
class TrajectoryInput:
    """One trajectory to roll out: a prompt, its answer, and where it sits in the batch."""

    #: The prompt as text and as token ids (``prompt_ids`` is what the engine sees).
    prompt: str
    prompt_ids: list[int]
    #: Reference answer handed to the reward function.
    answer: str
    #: Trajectories of the same prompt share a group (GRPO/RLOO compare within a group).
    group_id: int
    #: Stable id (``step-group-sample``): engines route it stickily, logs name it.
    trajectory_id: str
    #: Seed for this trajectory's sampling (reproducible rollouts).
    seed: int
    #: Free-form per-example data for custom environments.
    extra: dict[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class GeneratorInput(Sequence[TrajectoryInput]):
    """The trajectories of one step (``len(prompts) * n_samples_per_prompt``), iterable."""

    items: tuple[TrajectoryInput, ...]
    #: Global step the rollouts belong to; ``weight_version`` of the policy that samples them.
    global_step: int = 0
    weight_version: int = 0

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> TrajectoryInput:  # type: ignore[override]
        return self.items[i]

    def __iter__(self) -> Iterator[TrajectoryInput]:
        return iter(self.items)


@attrs.define
class Trajectory:
    """One rolled-out trajectory, ready for training.

    ``response_ids`` holds everything after the prompt: model tokens (``loss_mask`` 1) and,
    in multi-turn rollouts, environment/tool tokens (``loss_mask`` 0). ``rollout_logprobs``
    has one entry per response token (0.0 for environment tokens).
    """

    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    reward: float
    rollout_logprobs: list[float]
    group_id: int
    #: ``stop``, ``length``, ``abort`` (engine aborted) or ``truncated`` (max_response_tokens).
    finish_reason: str = "stop"
    num_turns: int = 1
    response_text: str = ""
    #: Per response token, the weight version that sampled it (-1 for environment tokens),
    #: where the trainer tracks it (``trainer.strategy=fully_async``: from
    #: ``Completion.weight_versions``, or filled in by the trainer when a generator leaves it
    #: empty); empty otherwise.
    weight_versions: list[int] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.loss_mask) != n or len(self.rollout_logprobs) != n:
            raise ValueError(
                f"trajectory lengths disagree: {n} response ids, {len(self.loss_mask)} loss-mask "
                f"entries, {len(self.rollout_logprobs)} logprobs"
            )
        if self.weight_versions and len(self.weight_versions) != n:
            raise ValueError(
                f"trajectory lengths disagree: {n} response ids, {len(self.weight_versions)} "
                "weight versions"
            )


@attrs.define
class GeneratorOutput:
    """The trajectories of a step, in the order of the input, plus generator metrics."""

    trajectories: list[Trajectory]
    metrics: dict[str, float] = attrs.field(factory=dict)


class Generator(abc.ABC):
    """Base class of rollout generators; subclass it and implement :meth:`generate`.

    A generator is built once per run as ``cls(engine=..., tokenizer=..., reward_fn=...,
    sampling=..., max_turns=..., max_response_tokens=...)`` and its ``generate`` is awaited
    once per step, inside the ``generate`` stage (and the step's deadline: a cancelled
    ``generate`` must let the cancellation propagate). Start one task per trajectory in a
    nursery you own; never leave tasks running after ``generate`` returns.
    """

    def __init__(
        self,
        *,
        engine: EngineClient,
        tokenizer: Any,
        reward_fn: RewardFn,
        sampling: SamplingParams,
        max_turns: int = 1,
        max_response_tokens: int = 64,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_fn
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens

    @abc.abstractmethod
    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        """Roll out every trajectory of ``batch``; return them in the same order."""
