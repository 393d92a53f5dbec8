"""``metrics.jsonl`` on resume: later steps dropped, a torn line dropped, a lost line restored."""

from __future__ import annotations

import json

from trainer.metrics import jsonable_row, restore_metrics


def _write(path, *rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_steps_after_the_checkpoint_are_dropped_and_eval_rows_before_it_kept(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, {"step": 1}, {"step": 2}, {"step": 2, "eval/reward_mean": 0.5}, {"step": 3})
    restore_metrics(path, 2)
    assert _steps(path) == [1, 2, 2]


def test_a_torn_last_line_is_dropped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, {"step": 1}, tail='{"step": 2, "rew')
    restore_metrics(path, 2)
    assert _steps(path) == [1]
    assert path.read_text().endswith("\n")


def test_the_checkpoint_row_fills_a_missing_line_and_never_doubles_one(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write(path, {"step": 1, "reward/mean": 0.1})
    restore_metrics(path, 2, {"step": 2, "reward/mean": 0.2})
    restore_metrics(path, 2, {"step": 2, "reward/mean": 0.2})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "reward/mean": 0.1},
        {"step": 2, "reward/mean": 0.2},
    ]


def test_a_run_killed_before_its_first_line_gets_the_checkpoint_row(tmp_path):
    path = tmp_path / "metrics.jsonl"
    restore_metrics(path, 1, {"step": 1})
    assert _steps(path) == [1]
    restore_metrics(tmp_path / "other.jsonl", 0)  # nothing to restore: no file made
    assert not (tmp_path / "other.jsonl").exists()


def test_non_finite_numbers_become_null():
    assert jsonable_row({"a": float("nan"), "b": float("inf"), "c": 1.5, "d": [1]}) == {
        "a": None,
        "b": None,
        "c": 1.5,
        "d": [1],
    }


def test_run_totals_sum_each_per_step_count_a_row_has():
    from trainer.metrics import RUN_TOTALS, run_totals

    rows = [
        {"step": 1, "reward/mean": 0.5, "reward/timeouts": 2.0, "dynamic_sampling/rounds": 3.0},
        {"step": 2, "reward/mean": 0.6, "reward/timeouts": 1.0, "reward/errors": None},
        {"step": 3, "reward/mean": 0.7, "dynamic_sampling/rounds": 1.0, "sync/resends": 1},
    ]
    assert run_totals(rows) == {
        "reward/timeouts": 3.0,
        "dynamic_sampling/rounds": 4.0,
        "sync/resends": 1.0,
    }
    assert "reward/mean" not in RUN_TOTALS  # a level, not a count: never summed
    assert run_totals([]) == {}
