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

``data.train=FILE.jsonl`` replaces it with ``{"prompt": str, "answer": str}`` rows, scored by
``data.reward_fn='module:function'`` (``(response: str, answer: str) -> float``); without a
reward function, exact match after stripping whitespace scores 1.0.
"""

from __future__ import annotations

import importlib
import json
import random
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from trainer.errors import ConfigError, DataError

__all__ = [
    "TASKS",
    "Example",
    "PromptLoader",
    "RewardFn",
    "digit_task_reward",
    "epoch_order",
    "exact_match_reward",
    "load_examples",
    "load_jsonl",
    "modular_sum_examples",
    "resolve_reward_fn",
    "task_examples",
]

RewardFn = Callable[[str, str], float]


@attrs.frozen
class Example:
    """One prompt and its reference answer."""

    prompt: str
    answer: str
    #: Position in its data file (1-based line) or task, for error messages and metrics.
    index: int = 0


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
    """Read ``{"prompt": str, "answer": str}`` rows; a bad row raises DataError naming file:line."""
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
        prompt, answer = row["prompt"], row["answer"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{where}: 'prompt' must be a non-empty string, got {prompt!r}")
        if isinstance(answer, int | float) and not isinstance(answer, bool):
            answer = str(answer)
        if not isinstance(answer, str):
            raise DataError(
                f"{where}: 'answer' must be a string or number, got {type(answer).__name__}"
            )
        examples.append(Example(prompt, answer, lineno))
    if not examples:
        raise DataError(f"{path}: the data file has no rows")
    return examples


def resolve_reward_fn(spec: str | None, default: RewardFn) -> RewardFn:
    """Import ``module:function`` (checked callable), or return ``default`` for None."""
    if spec is None:
        return default
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"config: data.reward_fn={spec!r}: cannot import {module_name!r} ({exc})"
        ) from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError(
            f"config: data.reward_fn={spec!r}: {module_name} has no callable {attr!r}"
        )
    return typing.cast(RewardFn, fn)


def load_examples(
    train: str | None, task: str, num_examples: int, seed: int
) -> tuple[list[Example], RewardFn]:
    """The training examples and their default reward function."""
    if train is not None:
        return load_jsonl(train), exact_match_reward
    return task_examples(task, num_examples, seed), digit_task_reward


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
        if "position" in state:
            raise ConfigError(
                "config: trainer.strategy='sync' cannot resume a checkpoint of a "
                "trainer.strategy='fully_async' run (its prompts in flight would be lost); resume "
                "with the first run's configuration (--config RUN_DIR/config.yaml "
                "trainer.resume_mode=latest)"
            )
        for field, key, mine in (
            ("seed", "trainer.seed", self.seed),
            ("batch_size", "trainer.train_batch_size", self.batch_size),
            ("num_examples", "the number of training prompts", len(self.examples)),
        ):
            saved = state.get(field)
            if saved is not None and int(saved) != mine:
                raise ConfigError(
                    f"config: {key} differs from the checkpoint's ({mine} here, {saved} in the "
                    "checkpoint): resuming would change the data order; resume with the first "
                    "run's configuration "
                    "(--config RUN_DIR/config.yaml trainer.resume_mode=latest)"
                )
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
