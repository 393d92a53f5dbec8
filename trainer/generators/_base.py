"""The public generator API (DESIGN 4.7): what a custom generator receives and returns."""

from __future__ import annotations

import abc
import ast
import difflib
import inspect
import textwrap
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs

from engines.types import EngineClient, SamplingParams
from trainer.data import RewardFn, RewardFunction, reward_function
from trainer.errors import ConfigError
from trainer.generators.chat import chat_turn_ids

__all__ = [
    "TRAINER_ARGUMENTS",
    "EngineClient",
    "Generator",
    "GeneratorInput",
    "GeneratorOutput",
    "Trajectory",
    "TrajectoryInput",
    "check_generator_kwargs",
]


@attrs.frozen
class TrajectoryInput:
    """One trajectory to roll out: a prompt, its answer, and where it sits in the batch."""

    #: The prompt as text and as token ids (``prompt_ids`` is what the engine sees). For a
    #: chat prompt, ``prompt`` is the rendered chat template and ``messages`` the messages.
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
    #: The data row's fields other than ``prompt`` and ``answer`` (this trajectory's copy).
    extra: dict[str, object] = attrs.field(factory=dict)
    #: The chat messages of a chat prompt (this trajectory's copy); None for a text prompt.
    messages: list[dict[str, object]] | None = None


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
    #: Numbers the environment reported for this trajectory (``EnvStep.metrics``, added up
    #: over its steps); ``AgentLoopGenerator`` reports their batch mean as ``generate/<name>``.
    metrics: dict[str, float] = attrs.field(factory=dict)

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


#: The keyword arguments the trainer passes to every generator's constructor.
TRAINER_ARGUMENTS = (
    "engine",
    "tokenizer",
    "reward_fn",
    "sampling",
    "max_turns",
    "max_response_tokens",
)


class Generator(abc.ABC):
    """Base class of rollout generators; subclass it and implement :meth:`generate`.

    A generator is built once per run as ``cls(engine=..., tokenizer=..., reward_fn=...,
    sampling=..., max_turns=..., max_response_tokens=..., **generator.kwargs)`` and its
    ``generate`` is awaited once per step, inside the ``generate`` stage (and the step's
    deadline: a cancelled ``generate`` must let the cancellation propagate). Start one task per
    trajectory in a nursery you own; never leave tasks running after ``generate`` returns.

    A subclass takes its own options as keyword arguments and passes the rest on
    (``def __init__(self, *, my_option=1, **kwargs): super().__init__(**kwargs)``); a keyword
    argument that reaches this constructor unconsumed is a ConfigError naming it and the
    class (a ``generator.kwargs`` key that no constructor takes). ``reward_fn`` is checked
    and wrapped once (:func:`trainer.data._examples.reward_function`): ``self.reward_fn(response,
    answer)`` and ``self.reward_fn(response, answer, extra=item.extra)`` both work, whichever
    of the two signatures the function has.
    """

    def __init__(
        self,
        *,
        engine: EngineClient,
        tokenizer: Any,
        reward_fn: RewardFn | RewardFunction,
        sampling: SamplingParams,
        max_turns: int = 1,
        max_response_tokens: int = 64,
        **unused: object,
    ) -> None:
        if unused:
            raise _unknown_kwarg(type(self), next(iter(unused)))
        self.engine = engine
        self.tokenizer = tokenizer
        self.reward_fn = reward_function(reward_fn)
        self.sampling = sampling
        self.max_turns = max_turns
        self.max_response_tokens = max_response_tokens

    def observation_ids(self, text: str, role: str = "user") -> list[int]:
        """``text`` as the tokens of a ``role`` chat turn plus the next generation prompt.

        What a chat environment appends after a model turn that ended with the end-of-turn
        token, rendered on its own with the chat template's turn markup (the history is never
        rendered again: see :func:`trainer.generators.chat.chat_turn_ids`). DataError when the
        tokenizer has no chat template; for text prompts encode the observation instead
        (``self.tokenizer.encode(text, add_special_tokens=False)``).
        """
        return chat_turn_ids(self.tokenizer, {"role": role, "content": text})

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """What the generator holds for the whole run (an environment server, an asyncio
        loop): the run enters this once, before the first step, and leaves it after the last
        (or when the run fails), after the steps' ``generate`` calls and before the engines
        stop. Override it to open run-scoped resources (``async with ...: yield``), each owned
        by a nursery opened here; an error raised here ends the run before the first step.
        The default holds nothing.
        """
        yield

    @abc.abstractmethod
    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        """Roll out every trajectory of ``batch``; return them in the same order."""


def check_generator_kwargs(cls: type[Generator], kwargs: Mapping[str, object]) -> None:
    """ConfigError, before anything starts, for ``generator.kwargs`` that ``cls`` cannot take.

    A key the trainer passes itself (:data:`TRAINER_ARGUMENTS`) is refused; so is a key that
    ``cls``'s constructor neither names nor could take through ``**kwargs``, and, where each
    ``**kwargs`` on the way to :class:`Generator` is handed on (``super().__init__(**kwargs)``,
    read from the source), a key no constructor of the chain names. Where one keeps them for
    itself (or its source cannot be read), a key nothing consumes fails when the generator is
    built (still before the first step).
    """
    for key in kwargs:
        if key in TRAINER_ARGUMENTS:
            raise ConfigError(
                f"config: generator.kwargs.{key} is set by the trainer itself; "
                + (
                    f"use generator.{key}"
                    if key.startswith("max_")
                    else "generator.kwargs holds only the generator's own options"
                )
            )
    if kwargs and next(k for k in cls.__mro__ if "__init__" in vars(k)) is Generator:
        raise _unknown_kwarg(cls, next(iter(kwargs)))  # Generator's own constructor: none
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        accepted = _handed_on_keywords(cls)
        for key in kwargs:
            if accepted is not None and key not in accepted:
                raise _unknown_kwarg(cls, key, accepted)
        return
    named = {n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for key in kwargs:
        if key not in named:
            raise _unknown_kwarg(cls, key, named)


def _handed_on_keywords(cls: type[Generator]) -> set[str] | None:
    """The keywords ``cls``'s constructors name on the way to :class:`Generator`'s, where each
    hands its ``**kwargs`` on to ``super().__init__``; None where one does not (or its source
    cannot be read): it may take any key."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None:
            continue
        if klass is Generator:
            return names
        try:
            params = list(inspect.signature(init).parameters.values())[1:]  # not self
        except (TypeError, ValueError):
            return None
        names.update(p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        rest = next((p.name for p in params if p.kind is p.VAR_KEYWORD), None)
        if rest is None:
            return names  # the chain ends here: nothing further is reached
        if not _hands_on(init, rest):
            return None
    return None


def _hands_on(init: object, rest: str) -> bool:
    """Whether ``init``'s source hands ``**rest`` on to ``super().__init__`` and does nothing
    else with it: a constructor that reads, pops, renames or rebuilds its keywords
    (``kwargs.pop("depth", 1)``) takes keys its signature does not name, so it is not checked.
    """
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(init)))  # type: ignore[arg-type]
    except (OSError, TypeError, SyntaxError):
        return False
    handed_on: list[ast.expr] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "__init__"
            and isinstance(node.func.value, ast.Call)
            and isinstance(node.func.value.func, ast.Name)
            and node.func.value.func.id == "super"
        ):
            handed_on += [k.value for k in node.keywords if k.arg is None]
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == rest]
    return bool(uses) and all(any(n is v for v in handed_on) for n in uses)


def _unknown_kwarg(cls: type, key: str, known: set[str] | None = None) -> ConfigError:
    close = difflib.get_close_matches(key, sorted(known or ()), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"config: generator.kwargs.{key}: {cls.__module__}:{cls.__qualname__} takes no keyword "
        f"argument {key!r}{hint}; remove it from generator.kwargs, or add it to the constructor "
        "(def __init__(self, *, NAME=DEFAULT, **kwargs): ...; super().__init__(**kwargs))"
    )
