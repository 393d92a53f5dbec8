"""The run's training prompts, eval prompts and reward function, from the ``data`` section.

One owner for what the run trains and evaluates on: a data file (``data.train``, scored by
exact match unless ``data.reward_fn`` says otherwise) or a built-in task (``data.task``): the
digit tasks of :mod:`trainer.data._examples`, the chat task ``addition`` (:mod:`trainer.data._addition`)
or reasoning-gym's datasets (:mod:`trainer.data._reasoning_gym`), whose eval prompts are held
out of training. ``data.eval`` replaces any task's eval prompts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from trainer.data._addition import addition_examples, addition_reward
from trainer.data._examples import (
    Example,
    RewardFunction,
    digit_task_reward,
    exact_match_reward,
    load_jsonl,
    resolve_reward_fn,
    task_examples,
)
from trainer.data._reasoning_gym import reasoning_gym_examples, reasoning_gym_reward
from trainer.errors import ConfigError

if TYPE_CHECKING:
    from trainer.config import DataConfig

__all__ = ["DIGIT_TASK_EVAL", "Datasets", "load_datasets"]

#: Eval prompts of the digit tasks (``max_digit``, ``modular_sum``) when
#: ``data.num_eval_examples`` is unset: their 100 pairs, which they also train on.
DIGIT_TASK_EVAL = 100


@attrs.frozen
class Datasets:
    train: list[Example]
    eval: list[Example]
    reward_fn: RewardFunction


def load_datasets(data: DataConfig, seed: int) -> Datasets:
    """The prompts and the reward of ``data`` (blocking: it reads files; run it in a thread).

    ConfigError for keys that do not fit together; DataError for a bad data file.
    """
    if data.task != "addition" and data.digits != 1:
        raise ConfigError(
            f"config: data.digits={data.digits} applies to data.task=addition only (the "
            f"task is {data.task!r}): unset it, or set data.task=addition"
        )
    if data.train is not None:
        train, default = load_jsonl(data.train), exact_match_reward
    elif data.task == "addition":
        train, default = _addition(data, seed)[0], addition_reward
    elif data.task == "reasoning_gym":
        train, default = reasoning_gym_examples(data, seed)[0], reasoning_gym_reward
    else:
        train, default = task_examples(data.task, data.num_examples, seed), digit_task_reward
    eval_examples = load_jsonl(data.eval) if data.eval is not None else _task_eval(data, seed)
    return Datasets(train, eval_examples, resolve_reward_fn(data.reward_fn, default))


def _addition(data: DataConfig, seed: int) -> tuple[list[Example], list[Example]]:
    return addition_examples(data.digits, data.num_examples, data.num_eval_examples, seed)


def _task_eval(data: DataConfig, seed: int) -> list[Example]:
    """``data.task``'s eval prompts (a data file without ``data.eval`` gets them too)."""
    if data.task == "addition":
        return _addition(data, seed)[1]
    if data.task == "reasoning_gym":
        return reasoning_gym_examples(data, seed)[1]
    return task_examples(data.task, data.num_eval_examples or DIGIT_TASK_EVAL, seed + 1)
