"""``data.reward_fn=math_verify``: math-verify's equivalence check as a reward (the ``envs`` extra).

math-verify (PyPI ``math-verify``, the checker behind TRL's and open-r1's accuracy rewards)
parses both texts into sympy (``\\boxed{}``, LaTeX and plain expressions: ``1/2``, ``0.5`` and
``\\frac{1}{2}`` are one value) and compares them. ``verify`` is not symmetric: its docstring
(math-verify 0.9.0, ``math_verify/grader.py``) says "Function is not symmetric, gold answer
should be passed as gold and prediction as pred", so the reference answer goes first.

Its timeouts use ``signal.alarm``, which works only in a process's main thread: there (a
reward worker process, ``data.reward_workers``, or the trainer's own loop thread) they stay
on; in any other thread they are turned off (``parsing_timeout=None``,
``timeout_seconds=None``) instead of failing, and only a worker process can then stop a
runaway comparison (``data.reward_timeout_s``).
"""

from __future__ import annotations

import threading
from typing import cast

from math_verify import parse, verify

__all__ = ["math_verify_reward"]


def math_verify_reward(response: str, answer: str) -> float:
    """1.0 when math-verify finds ``response`` equal to the reference ``answer``, else 0.0.

    A reference written bare (no ``$`` and no ``\\boxed``: ``x+1``, ``\\sqrt{2}``) is read
    as one LaTeX formula (``$x+1$``); math-verify reads a bare ``x+1`` as no answer. The
    response is parsed as written: a model answers in ``\\boxed{}`` or ``$...$`` (plain
    numbers and fractions parse too). Nothing parsed on either side scores 0.0.
    """
    # None turns the signal.alarm timeout off (math-verify 0.9.0 documents it, though its
    # annotation says int); the default, 5 s, is kept where the alarm can fire
    seconds = 5 if threading.current_thread() is threading.main_thread() else None
    bare = "$" not in answer and "\\boxed" not in answer
    gold = parse(f"${answer}$" if bare else answer, parsing_timeout=cast(int, seconds))
    pred = parse(response, parsing_timeout=cast(int, seconds))
    if not gold or not pred:
        return 0.0
    return float(verify(gold, pred, timeout_seconds=seconds))
