"""A real distillation run (``algorithm.distillation``): the teacher, a reference engine
server the trainer starts, serves the student's own initial weights, so the reverse KL of step
1 is 0 to float precision (the teacher's prompt logprobs and the engine's sampling logprobs
of the same weights agree); the task's advantage (``reward_weight``) then moves the student
away and the reverse KL of the later steps is positive. One run for every assertion.

That the reverse KL to a different teacher falls step over step takes more steps than a test
affords on the tiny model: ``benchmarks/distillation.py`` measures it
(docs/algorithms.md#on-policy-distillation)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

import trainer.run
from engines.models import build_tiny_model
from trainer.config import load_config


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    run_dir = tmp_path_factory.mktemp("distill")
    over = [
        "engine.backend=inprocess",
        "trainer.progress=false",
        "trainer.max_steps=3",
        "trainer.train_batch_size=4",
        "generator.n_samples_per_prompt=4",
        "optim.lr=1e-2",
        f"algorithm.distillation.teacher_path={build_tiny_model()}",
        "algorithm.distillation.reward_weight=1.0",
        "data.reward_fn=tests.trainer.helpers:varied_reward",  # a task that moves the student
        f"trainer.run_dir={run_dir}",
    ]
    trio.run(trainer.run.train, load_config(None, over))
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return run_dir, [r for r in rows if "distill/reverse_kl" in r]


def test_a_teacher_with_the_students_weights_is_at_reverse_kl_zero(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = run
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-4


def test_once_the_student_moves_its_reverse_kl_to_the_teacher_is_positive(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    _, rows = run
    assert all(r["distill/reverse_kl"] > 1e-3 for r in rows[1:]), rows


def test_the_teacher_is_timed_as_its_own_stage_and_logs_to_the_run(
    run: tuple[Path, list[dict[str, Any]]],
) -> None:
    run_dir, rows = run
    assert all(r["timing/teacher_logprobs"] > 0 for r in rows)
    assert (run_dir / "teacher" / "engine-0.log").is_file()
