"""data.reward_fn=math_verify: math-verify's equivalence check, gold first, in any thread."""

from __future__ import annotations

import threading

import pytest

from trainer.config import load_config
from trainer.data import load_datasets

pytest.importorskip("math_verify")

EQUIVALENT = [
    ("0.5", "1/2"),
    ("\\frac{1}{2}", "1/2"),
    ("$\\frac{1}{2}$", "0.5"),
    ("$1+x$", "x+1"),
    ("The answer is \\boxed{1+x}.", "x+1"),
    ("\\boxed{4}", "4"),
    ("$2^{1/2}$", "\\sqrt{2}"),
    ("so $x = 3$", "3"),
]
DIFFERENT = [
    ("0.25", "1/2"),
    ("$x-1$", "x+1"),
    ("\\boxed{5}", "4"),
    ("I do not know", "4"),
    ("$\\sqrt{3}$", "\\sqrt{2}"),
]


@pytest.fixture(scope="module")
def reward():
    cfg = load_config(None, ["data.reward_fn=math_verify"])
    return load_datasets(cfg.data, 0).reward_fn


def _scores(reward, cases):
    return [reward(response, gold) for response, gold in cases]


def test_equivalent_answers_score_one_and_different_ones_zero(reward):
    assert _scores(reward, EQUIVALENT) == [1.0] * len(EQUIVALENT)
    assert _scores(reward, DIFFERENT) == [0.0] * len(DIFFERENT)


def test_outside_the_main_thread_it_scores_the_same_instead_of_failing(reward):
    got: list[list[float]] = []
    worker = threading.Thread(target=lambda: got.append(_scores(reward, EQUIVALENT + DIFFERENT)))
    worker.start()
    worker.join()
    assert got == [[1.0] * len(EQUIVALENT) + [0.0] * len(DIFFERENT)]


def test_its_name_is_what_reward_errors_and_workers_use(reward):
    assert reward.name == "math_verify"


def test_the_built_in_reward_names_are_the_ones_the_config_accepts():
    from trainer.config._data import BUILTIN_REWARDS as ACCEPTED
    from trainer.data._examples import BUILTIN_REWARDS

    assert set(BUILTIN_REWARDS) == set(ACCEPTED)
