"""The built-in chat task ``addition``: "What is A + B?" asked of a pretrained instruct model.

``data.task=addition`` asks ``What is A + B? Reply with only the number.`` as one user chat
message (rendered with the model's chat template), A and B drawn from ``0 .. 10**data.digits
- 1``. Each row's answer is A + B, and its :attr:`~trainer.data._examples.Example.extra` holds
``{"a": A, "b": B}``; :func:`addition_reward` pays 1.0 when the reply's last integer is the
answer, else 0 (an instruct model that explains its sum before it gives it is right, one that
stops mid-number is not).

The pairs are split once, by the seed: the eval prompts (``data.num_eval_examples``; by
default a fifth of the pairs, at most 200) are held out, and the training prompts cycle over
the rest, so ``eval/reward_mean`` measures prompts the policy never trained on. Why a sum:
an instruct model of 135M parameters answers one-digit sums greedily (about 78% right) but
seldom when sampled at temperature 1 (about 15%, measured on SmolLM2-135M-Instruct), and
that gap is what RL closes in minutes on a CPU (docs/real_model.md).
"""

from __future__ import annotations

import random
import re

from trainer.data._examples import Example
from trainer.errors import ConfigError

__all__ = ["PROMPT", "addition_examples", "addition_reward", "default_num_eval"]

#: The user message of every ``addition`` prompt.
PROMPT = "What is {a} + {b}? Reply with only the number."

_INTEGER = re.compile(r"-?\d+")


def _num_pairs(digits: int) -> int:
    return (10**digits) ** 2


def default_num_eval(digits: int) -> int:
    """The held-out prompts when ``data.num_eval_examples`` is unset: a fifth, at most 200."""
    return min(200, _num_pairs(digits) // 5)


def addition_examples(
    digits: int, num_examples: int, num_eval: int | None, seed: int
) -> tuple[list[Example], list[Example]]:
    """``(train, eval)``: ``num_eval`` (None: :func:`default_num_eval`) held-out eval prompts,
    and ``num_examples`` training prompts over other pairs (cycling when fewer pairs are
    left), all drawn by ``seed``."""
    total, top = _num_pairs(digits), 10**digits
    held = default_num_eval(digits) if num_eval is None else num_eval
    if not 1 <= held <= total // 2:
        raise ConfigError(
            f"config: data.num_eval_examples={held} is out of range for data.task=addition "
            f"with data.digits={digits}: its {total} pairs allow 1 to {total // 2} held-out "
            "prompts (the rest train); lower it, or raise data.digits"
        )
    drawn = random.Random(f"addition:{seed}").sample(range(total), min(total, held + num_examples))
    pairs = [divmod(i, top) for i in drawn]
    eval_pairs, train_pairs = pairs[:held], pairs[held:]
    train = [_example(*train_pairs[i % len(train_pairs)], i) for i in range(num_examples)]
    return train, [_example(a, b, i) for i, (a, b) in enumerate(eval_pairs)]


def _example(a: int, b: int, index: int) -> Example:
    message = {"role": "user", "content": PROMPT.format(a=a, b=b)}
    return Example((message,), str(a + b), index, extra={"a": a, "b": b})


def addition_reward(response: str, answer: str) -> float:
    """1.0 when the last integer in ``response`` equals ``answer``, else 0.0."""
    numbers = _INTEGER.findall(response)
    return float(bool(numbers) and numbers[-1].lstrip("0") == answer.strip().lstrip("0"))
