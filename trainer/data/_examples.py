"""Prompts, answers, rewards and the resumable data order.

The built-in tasks ask about a pair of digits: ``max_digit`` (the default) asks ``max A B =``
and expects the larger digit (``max 7 5 =`` -> ``7``); ``modular_sum`` asks ``sum A B =`` and
expects the last digit of A + B. Why ``max_digit`` by default: the tiny model starts from
random weights, so the task must (1) pay a random policy something, so GRPO groups have
reward variance from step one, (2) be a real input-dependent mapping (100 prompts, 10
answers, no single answer wins), and (3) be learnable on two CPU cores in minutes: the answer
is always one of the prompt's digits, so copying a digit is a first foothold and comparing
them the rest. ``modular_sum`` needs both digits combined and learns much more slowly here.
The reward is shaped for (1): 1.0 for exactly the right digit, 0.5 when the right digit comes
first but more text follows, 0.1 for a lone wrong digit, 0 otherwise; a random policy earns
~0.01, a learned one ~1.0.

``data.train=FILE.jsonl`` replaces it with ``{"prompt": ..., "answer": str, ...}`` rows: the
prompt is a string or a list of chat messages (rendered with the model's chat template), and
every other field of the row is kept in :attr:`Example.extra`. Rows are scored by
``data.reward_fn='module:function'``, either ``(response: str, answer: str) -> float`` or
``(response: str, answer: str, *, extra: Mapping[str, Any]) -> float`` (it then gets the row's
extra fields); without a reward function, exact match after stripping whitespace scores 1.0.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import attrs

from trainer.errors import ConfigError, DataError

__all__ = [
    "BUILTIN_REWARDS",
    "REWARD_SIGNATURES",
    "TASKS",
    "ChatMessage",
    "Example",
    "PromptLoader",
    "RewardFn",
    "RewardFunction",
    "check_same_order",
    "digit_task_reward",
    "epoch_order",
    "exact_match_reward",
    "load_jsonl",
    "modular_sum_examples",
    "resolve_reward_fn",
    "reward_function",
    "task_examples",
]

#: A reward function: ``(response, answer) -> float`` or ``(response, answer, *, extra) -> float``
#: (see :data:`REWARD_SIGNATURES`), plain or ``async def``; :func:`reward_function` tells which,
#: once.
RewardFn = Callable[..., float]

#: The signatures a reward function may have, as error messages and docs name them.
REWARD_SIGNATURES = (
    "(response: str, answer: str) -> float",
    "(response: str, answer: str, *, extra: Mapping[str, Any]) -> float",
)

#: One chat message of a prompt, as the data file holds it (``role``, ``content``, maybe more).
ChatMessage = Mapping[str, Any]


def _read_only_messages(prompt: str | tuple[ChatMessage, ...]) -> str | tuple[ChatMessage, ...]:
    if isinstance(prompt, str):
        return prompt
    return tuple(MappingProxyType(dict(m)) for m in prompt)


def _read_only(extra: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(extra))


@attrs.frozen
class Example:
    """One prompt, its reference answer and the rest of its data row.

    ``prompt`` and ``extra`` are read-only (an example is shared by every step that draws
    it); each trajectory gets its own copies (:func:`trainer.loop._stages.group_inputs`).
    ``prompt`` and ``extra`` take no part in the hash (mappings are not hashable).
    """

    #: A plain-text prompt, or chat messages rendered with the model's chat template.
    prompt: str | tuple[ChatMessage, ...] = attrs.field(converter=_read_only_messages, hash=False)
    answer: str
    #: Position in its data file (1-based line) or task, for error messages and metrics.
    index: int = 0
    #: The data row's fields other than ``prompt`` and ``answer`` (empty for built-in tasks).
    extra: Mapping[str, Any] = attrs.field(
        factory=dict, converter=_read_only, hash=False, kw_only=True
    )

    @property
    def is_chat(self) -> bool:
        """Whether the prompt is chat messages (rendered with the chat template)."""
        return not isinstance(self.prompt, str)


#: Built-in tasks: prompt verb and the answer digit for a pair of digits.
TASKS: dict[str, tuple[str, Callable[[int, int], int]]] = {
    "max_digit": ("max", max),
    "modular_sum": ("sum", lambda a, b: (a + b) % 10),
}


def task_examples(task: str, n: int, seed: int) -> list[Example]:
    """``n`` prompts ``VERB A B =`` (A, B digits) cycling over all 100 pairs in seeded order."""
    if task not in TASKS:
        raise ConfigError(
            f"config: data.task={task!r} is not allowed: choose one of {', '.join(map(repr, TASKS))}"
        )
    verb, answer = TASKS[task]
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return [
        Example(f"{verb} {a} {b} =", str(answer(a, b)), i)
        for i, (a, b) in ((i, pairs[i % len(pairs)]) for i in range(n))
    ]


def modular_sum_examples(n: int, seed: int) -> list[Example]:
    """The ``modular_sum`` task: ``sum A B =`` -> last digit of A + B."""
    return task_examples("modular_sum", n, seed)


def digit_task_reward(response: str, answer: str) -> float:
    """1.0 exact, 0.5 right digit first, 0.1 a lone wrong digit, else 0 (see module doc)."""
    words = response.split()
    if words == [answer]:
        return 1.0
    if words and words[0] == answer:
        return 0.5
    if len(words) == 1 and words[0].isdigit():
        return 0.1
    return 0.0


def exact_match_reward(response: str, answer: str) -> float:
    """1.0 when the response equals the answer after stripping whitespace, else 0.0."""
    return float(response.strip() == answer.strip())


def load_jsonl(path: str | Path) -> list[Example]:
    """Read ``{"prompt": ..., "answer": ..., ...}`` rows; a bad row raises DataError naming file:line.

    ``prompt`` is a non-empty string or a non-empty list of chat messages (objects with a
    string ``role`` and a string ``content``, plus any other keys the chat template reads);
    ``answer`` a string or a number. The row's other fields become :attr:`Example.extra`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DataError(f"{path}: cannot read the data file: {exc.strerror or exc}") from None
    examples = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(
                f"{where}: expected an object with 'prompt' and 'answer', got {type(row).__name__}"
            )
        for key in ("prompt", "answer"):
            if key not in row:
                raise DataError(f"{where}: missing required field {key!r}")
        prompt, answer = row.pop("prompt"), row.pop("answer")
        if isinstance(prompt, list):
            _check_messages(where, prompt)
        elif not isinstance(prompt, str) or not prompt.strip():
            raise DataError(
                f"{where}: 'prompt' must be a non-empty string or a list of chat messages, "
                f"got {prompt!r}"
            )
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(
                f"{where}: 'answer' must be a string or number, got {type(answer).__name__}"
            )
        examples.append(
            Example(prompt if isinstance(prompt, str) else tuple(prompt), answer, lineno, extra=row)
        )
    if not examples:
        raise DataError(f"{path}: the data file has no rows")
    return examples


def _check_messages(where: str, messages: list[Any]) -> None:
    """Raise DataError unless ``messages`` is a non-empty list of ``{role, content}`` objects."""
    if not messages:
        raise DataError(f"{where}: 'prompt' is an empty list; give at least one chat message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise DataError(
                f"{where}: 'prompt' message {i} must be an object with 'role' and 'content', "
                f"got {type(message).__name__}"
            )
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise DataError(
                f"{where}: 'prompt' message {i} needs a non-empty string 'role', got {role!r}"
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: 'prompt' message {i} needs a string 'content', got "
                f"{type(content).__name__}"
            )


@attrs.frozen
class RewardFunction:
    """A reward function and how it is called, decided once (:func:`reward_function`).

    Calling it always takes ``(response, answer, extra=...)``; ``extra`` reaches the function
    only when it accepts it, so a ``(response, answer)`` function keeps working. An ``async
    def`` function returns an awaitable when called: use :meth:`score`.
    """

    fn: RewardFn
    #: Whether ``fn`` takes ``extra=`` (a parameter named ``extra``, or ``**kwargs``).
    takes_extra: bool
    #: Whether ``fn`` is an ``async def`` (awaited on the loop by :meth:`score`).
    is_async: bool = False
    #: How config named it (``data.reward_fn``: ``module:function`` or a built-in name).
    spec: str | None = None
    #: The run's :class:`~trainer.data._reward_runner.RewardRunner` (bound by
    #: :func:`~trainer.data.open_rewards`): where :meth:`score` runs the call, and its bound.
    runner: Any = attrs.field(default=None, eq=False, repr=False)

    @property
    def name(self) -> str:
        """``spec``, else ``module:qualname`` (how a worker process imports it)."""
        fn = self.fn
        return self.spec or f"{fn.__module__}:{getattr(fn, '__qualname__', type(fn).__qualname__)}"

    def __call__(self, response: str, answer: str, extra: Mapping[str, Any] | None = None) -> Any:
        if self.takes_extra:
            return self.fn(response, answer, extra=extra if extra is not None else {})
        return self.fn(response, answer)

    async def score(
        self, response: str, answer: str, extra: Mapping[str, Any] | None = None
    ) -> float:
        """The reward, run as the run's ``data.reward_*`` keys say (see
        :mod:`trainer.data._reward_runner`): in a worker process, awaited under a bound, or
        called here. Unbound (no run), a plain function is called and an async one awaited.
        RewardError past ``data.max_reward_failures`` failures in a batch.
        """
        if self.runner is not None:
            return await self.runner.score(self, response, answer, extra)
        if self.is_async:
            return float(await self(response, answer, extra))
        return float(self(response, answer, extra))


def _is_async(fn: object) -> bool:
    """An ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def reward_function(fn: RewardFn | RewardFunction, where: str | None = None) -> RewardFunction:
    """``fn`` with its signature checked; ConfigError naming it and :data:`REWARD_SIGNATURES`.

    A parameter named ``extra`` (after ``response`` and ``answer``, not positional-only) or
    ``**kwargs`` makes it take the example's extra fields. A callable whose signature cannot
    be read (some builtins) is taken as ``(response, answer)``. ``where`` starts the error
    message (default: ``reward function NAME``).
    """
    if isinstance(fn, RewardFunction):
        return fn
    is_async = _is_async(fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return RewardFunction(fn, takes_extra=False, is_async=is_async)
    extra = sig.parameters.get("extra")
    takes_extra = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()) or (
        extra is not None and extra.kind is not extra.POSITIONAL_ONLY
    )
    try:
        if takes_extra:
            sig.bind("response", "answer", extra={})
        else:
            sig.bind("response", "answer")
    except TypeError:
        name = getattr(fn, "__qualname__", type(fn).__qualname__)
        bare = sig.replace(  # names and kinds only: annotations may be strings or absent
            parameters=[p.replace(annotation=p.empty) for p in sig.parameters.values()],
            return_annotation=sig.empty,
        )
        raise ConfigError(
            f"config: {where or 'reward function'}: {name}{bare} has the wrong signature; a "
            f"reward function is {' or '.join(REWARD_SIGNATURES)}"
        ) from None
    return RewardFunction(fn, takes_extra=takes_extra, is_async=is_async)


#: Reward functions ``data.reward_fn`` names without a module, and where they live.
BUILTIN_REWARDS = {"math_verify": "trainer.data._math_verify:math_verify_reward"}


def resolve_reward_fn(spec: str | None, default: RewardFn) -> RewardFunction:
    """Import ``module:function`` or a built-in one by name (:data:`BUILTIN_REWARDS`; its
    signature checked), or ``default`` for None."""
    if spec is None:
        return reward_function(default)
    module_name, _, attr = BUILTIN_REWARDS.get(spec, spec).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        extra = (
            "; built-in rewards need the envs extra: `bash setup.sh --envs`"
            if spec in BUILTIN_REWARDS
            else ""
        )
        raise ConfigError(
            f"config: data.reward_fn={spec!r}: cannot import {module_name!r} ({exc}){extra}"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"config: data.reward_fn={spec!r}: {module_name} has no callable {attr!r}"
        )
    checked = reward_function(typing.cast(RewardFn, fn), where=f"data.reward_fn={spec!r}")
    return attrs.evolve(checked, spec=spec)


def check_same_order(state: dict[str, Any], *fields: tuple[str, str, int]) -> None:
    """ConfigError if a checkpoint's data ``state`` was made with another order.

    Each field is ``(state key, config key named in the error, this run's value)``; a key the
    state lacks (saved before it existed) is accepted.
    """
    for field, key, mine in fields:
        saved = state.get(field)
        if saved is not None and int(saved) != mine:
            raise ConfigError(
                f"config: {key} differs from the checkpoint's ({mine} here, {saved} in the "
                "checkpoint): resuming would change the data order; resume with the first "
                "run's configuration (--config RUN_DIR/config.yaml trainer.resume_mode=latest)"
            )


def check_same_strategy(state: dict[str, Any], mine: str) -> None:
    """ConfigError if a checkpoint's data ``state`` was saved under another
    ``trainer.strategy`` than ``mine``: a synchronous loop's batches are not a fully-async
    stream's groups (and a fully-async checkpoint's prompts in flight would be lost). The state
    names its strategy; one saved before it did is told by its fields (only the stream keeps
    a ``position``)."""
    saved = state.get("strategy") or ("fully_async" if "position" in state else "sync")
    if saved != mine:
        lost = " (its prompts in flight would be lost)" if saved == "fully_async" else ""
        raise ConfigError(
            f"config: trainer.strategy={mine!r} cannot resume a checkpoint of a "
            f"trainer.strategy={saved!r} run{lost}; resume with the first run's configuration "
            "(--config RUN_DIR/config.yaml trainer.resume_mode=latest)"
        )


def epoch_order(num_examples: int, seed: int, epoch: int) -> list[int]:
    """The order of the examples in epoch ``epoch``: a permutation seeded by ``(seed, epoch)``."""
    order = list(range(num_examples))
    random.Random(f"{seed}:{epoch}").shuffle(order)
    return order


@attrs.define(eq=False)
class PromptLoader:
    """Batches of prompts in a seeded order per epoch; its position is saved in checkpoints.

    The order of epoch ``e`` is a permutation seeded by ``(seed, e)``, so a run resumed from
    ``state_dict()`` yields exactly the batches an uninterrupted run would. Incomplete last
    batches are dropped.
    """

    examples: list[Example]
    batch_size: int
    seed: int
    epoch: int = 0
    index: int = 0

    def __attrs_post_init__(self) -> None:
        if self.batch_size > len(self.examples):
            raise ConfigError(
                f"config: trainer.train_batch_size={self.batch_size} is out of range: the data has "
                f"only {len(self.examples)} prompts"
            )

    @property
    def batches_per_epoch(self) -> int:
        return len(self.examples) // self.batch_size

    def next_batch(self) -> list[Example]:
        if self.index >= self.batches_per_epoch:
            self.epoch += 1
            self.index = 0
        order = epoch_order(len(self.examples), self.seed, self.epoch)
        start = self.index * self.batch_size
        self.index += 1
        return [self.examples[i] for i in order[start : start + self.batch_size]]

    def state_dict(self) -> dict[str, Any]:
        """The position, plus what fixes the order (checked by :meth:`load_state_dict`)."""
        return {
            "epoch": self.epoch,
            "strategy": "sync",
            "index": self.index,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "num_examples": len(self.examples),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue at ``state``'s position; ConfigError if this loader's order differs.

        A resume with another ``trainer.seed``, ``trainer.train_batch_size`` or number of
        prompts would silently train on other batches than the interrupted run; the error names
        the key and the checkpoint's value. States saved before these fields existed are
        accepted as they are.
        """
        check_same_strategy(state, "sync")
        check_same_order(
            state,
            ("seed", "trainer.seed", self.seed),
            ("batch_size", "trainer.train_batch_size", self.batch_size),
            ("num_examples", "the number of training prompts", len(self.examples)),
        )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
