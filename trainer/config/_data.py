"""The ``data`` section: prompts, tasks and rewards."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from trainer.config._fields import at_least, in_range, module_attr, positive
from trainer.config._fields import config_field as _field
from trainer.config._fields import config_section as _section
from trainer.config._reasoning_gym import ReasoningGymConfig

__all__ = ["BUILTIN_REWARDS", "DataConfig", "ReasoningGymConfig"]


#: Reward functions ``data.reward_fn`` names without a module (:mod:`trainer.data`'s registry).
BUILTIN_REWARDS = ("math_verify",)


def _reward_fn(v: Any) -> str | None:
    if v in BUILTIN_REWARDS or module_attr(v) is None:
        return None
    return f"must be 'package.module:function' or a built-in one: {', '.join(BUILTIN_REWARDS)}"


@attrs.define
class DataConfig:
    train: str | None = _field(
        None,
        "Training prompts, a JSONL file of {prompt, answer, ...} rows: prompt a string or a "
        "list of chat messages, other fields reach the generator and reward function as extra "
        "(None: the built-in task).",
    )
    eval: str | None = _field(None, "Evaluation prompts, same format.")
    reward_fn: str | None = _field(
        None,
        "Reward function 'module:function', (response: str, answer: str) -> float or "
        "(response, answer, *, extra) -> float to get the row's extra fields, sync or async "
        "def; or a built-in one by name: 'math_verify' (None: the task's).",
        check=_reward_fn,
    )
    reward_workers: int = _field(
        0,
        "Processes that run a (sync) reward function, each call bounded by "
        "data.reward_timeout_s (a call past it is killed and its worker replaced); 0: it runs "
        "in the trainer's event loop, unbounded, and an exception ends the run.",
        check=at_least(0),
    )
    reward_max_memory_mb: int | None = _field(
        4096,
        "MiB of data (heap and private memory, RLIMIT_DATA) each reward worker process may "
        "hold, what it starts included (data.reward_workers > 0); an allocation past it raises "
        "MemoryError in the reward, counted in reward/errors (None: no limit of its own).",
        check=at_least(64),
    )
    reward_timeout_s: float | None = _field(
        None,
        "Seconds one reward call may take in a worker process (data.reward_workers > 0) or as "
        "an async def on the loop; past it the call scores data.reward_on_failure and counts in "
        "reward/timeouts (None: no bound of its own, the step's deadline still applies).",
        check=positive,
    )
    reward_on_failure: float = _field(
        0.0,
        "The reward of a call that timed out or raised (workers or async rewards; counted in "
        "reward/timeouts and reward/errors).",
    )
    max_reward_failures: int = _field(
        0,
        "Failed reward calls (timeouts plus errors) allowed in one batch of rollouts (one "
        "generate call; one step of the synchronous loop); one more ends the run with "
        "RewardError naming the function and a failing sample.",
        check=at_least(0),
    )
    task: Literal["max_digit", "modular_sum", "addition", "reasoning_gym"] = _field(
        "max_digit",
        "Built-in task when data.train is None (see docs/concepts.md); 'addition' is a chat "
        "task for pretrained instruct models (docs/real_model.md); 'reasoning_gym' takes its "
        "datasets from data.reasoning_gym (docs/environments.md).",
    )
    reasoning_gym: ReasoningGymConfig = _section(
        ReasoningGymConfig, "data.task=reasoning_gym: reasoning-gym's procedural datasets."
    )
    num_examples: int = _field(512, "Prompts the built-in task generates.", check=at_least(1))
    digits: int = _field(
        1, "data.task=addition: digits of each operand (1: 0-9, 2: 0-99).", check=in_range(1, 9)
    )
    num_eval_examples: int | None = _field(
        None,
        "Eval prompts the built-in task generates (None: 100 for the digit tasks, which train on "
        "the same pairs; for addition a fifth of its pairs, at most 200, held out of training; "
        "for reasoning_gym 100 items drawn past training's seeds, those asked in training left out).",
        check=at_least(1),
    )
    max_prompt_length: int | None = _field(
        None,
        "Longest prompt in tokens, as the engine sees it (chat prompts rendered); longer ones "
        "are handled by data.overlong_prompts (None: no limit of its own; the engines' context "
        "less generator.sampling.max_tokens is still checked at start-up).",
        check=at_least(1),
    )
    overlong_prompts: Literal["error", "drop"] = _field(
        "error",
        "A prompt longer than data.max_prompt_length: 'error' stops the run at start-up naming "
        "its row; 'drop' leaves it out of training and eval (logged with the count).",
    )
