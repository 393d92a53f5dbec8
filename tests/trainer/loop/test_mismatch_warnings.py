"""The mismatch diagnostics on the console (a warning past a threshold, not under it), in a
step's metrics through the real loop, in ``summary.json`` and in the closing lines."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import trainer.run
from trainer.config import load_config
from trainer.loop._mismatch import SUSPECTS, mismatch_warnings
from trainer.metrics import mismatch_summary

THRESHOLDS = {"max_logprob_abs_diff_mean": 0.1, "min_prob_pearson": 0.9, "min_is_ess": 0.5}
HEALTHY = {
    "mismatch/logprob_abs_diff_mean": 0.01,
    "mismatch/logprob_abs_diff_max": 3.0,  # no threshold: one wild token is not a mismatch
    "mismatch/prob_pearson": 0.99,
    "mismatch/is_ess": 0.97,
}


@pytest.mark.parametrize(
    ("metric", "value", "key"),
    [
        ("mismatch/logprob_abs_diff_mean", 0.25, "max_logprob_abs_diff_mean"),
        ("mismatch/prob_pearson", 0.5, "min_prob_pearson"),
        ("mismatch/is_ess", 0.3, "min_is_ess"),
    ],
)
def test_a_diagnostic_past_its_threshold_warns_naming_it(caplog, metric, value, key):
    with caplog.at_level(logging.WARNING, logger="trainer.mismatch"):
        assert mismatch_warnings(HEALTHY | {metric: value}, THRESHOLDS, 7) == 1
    (record,) = caplog.records
    message = record.getMessage()
    assert message.startswith(f"step 7: {metric}={value:.4g} is ")
    assert f"algorithm.mismatch.{key}={THRESHOLDS[key]:g}" in message
    assert SUSPECTS in message and "stale" in message and "LoRA" in message
    assert "temperature" in message


def test_under_its_threshold_or_with_none_it_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING, logger="trainer.mismatch"):
        assert mismatch_warnings(HEALTHY, THRESHOLDS, 1) == 0
        at_bounds = {
            "mismatch/logprob_abs_diff_mean": 0.1,
            "mismatch/prob_pearson": 0.9,
            "mismatch/is_ess": 0.5,
        }
        assert mismatch_warnings(at_bounds, THRESHOLDS, 2) == 0
        off = dict.fromkeys(THRESHOLDS)
        assert mismatch_warnings(HEALTHY | {"mismatch/is_ess": 0.01}, off, 3) == 0
    assert caplog.records == []


def test_each_diagnostic_is_its_own_kind_of_repeated_warning(caplog):
    bad = {"mismatch/logprob_abs_diff_mean": 1.0, "mismatch/is_ess": 0.1}
    with caplog.at_level(logging.WARNING, logger="trainer.mismatch"):
        assert mismatch_warnings(bad, THRESHOLDS, 1) == 2
        assert mismatch_warnings(bad, THRESHOLDS, 2) == 2
    templates = [r.msg for r in caplog.records]
    assert len(set(templates)) == 2  # the aggregation counts each one across steps


def test_the_summary_keeps_each_diagnostics_mean_and_worst_step():
    rows = [
        {"step": 1, "mismatch/logprob_abs_diff_mean": 0.02, "mismatch/is_ess": 0.9},
        {"step": 2, "mismatch/logprob_abs_diff_mean": 0.30, "mismatch/is_ess": 0.4},
        {"step": 3, "mismatch/logprob_abs_diff_mean": 0.04, "mismatch/is_ess": 0.8},
    ]
    assert mismatch_summary(rows) == {
        "logprob_abs_diff_mean": {"mean": pytest.approx(0.12), "worst": 0.30, "worst_step": 2.0},
        "is_ess": {"mean": pytest.approx(0.7), "worst": 0.4, "worst_step": 2.0},
    }
    assert mismatch_summary([{"step": 1, "reward/mean": 0.0}]) == {}


def test_the_closing_lines_say_where_the_run_crossed(capsys):
    from trainer.__main__ import _print_summary

    base = {"run_dir": "runs/x", "steps": 3.0}
    mismatch = {"is_ess": {"mean": 0.7, "worst": 0.4, "worst_step": 2.0}}
    _print_summary(base | {"totals": {"mismatch/crossed": 0.0}, "mismatch": mismatch})
    assert "disagreed" not in capsys.readouterr().err
    _print_summary(base | {"totals": {"mismatch/crossed": 1.0}, "mismatch": mismatch})
    err = capsys.readouterr().err
    assert "1 mismatch/crossed" in err
    assert "worst: is_ess 0.4 at step 2" in err


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


RUN = ["engine.backend=inprocess", "trainer.progress=false", "trainer.max_steps=2"]


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # one update per batch: the update's forward is the old policy's
        ["trainer.update_epochs=2"],  # the loop recomputes the old logprobs
        ["algorithm.rollout_correction.rollout_rs=token"],  # recomputed, before the mask
    ],
)
async def test_every_step_of_a_real_run_reports_them_and_nothing_else(tmp_path, overrides):
    cfg = load_config(None, [*RUN, f"trainer.run_dir={tmp_path}", *overrides])
    summary = await trainer.run.train(cfg)
    rows = _rows(tmp_path)
    assert len(rows) == 2
    for r in rows:
        assert not any(k.startswith("mismatch_sums/") for k in r), r
        # the reference engine samples with the trained weights in float32: no mismatch
        assert 0 <= r["mismatch/logprob_abs_diff_mean"] < 1e-3
        assert r["mismatch/logprob_abs_diff_max"] >= r["mismatch/logprob_abs_diff_mean"]
        assert r["mismatch/is_ess"] == pytest.approx(1.0, abs=1e-4)
        assert r["mismatch/prob_pearson"] == pytest.approx(1.0, abs=1e-4)
        assert r["mismatch/crossed"] == 0.0
    assert set(summary["mismatch"]) == {
        "logprob_abs_diff_mean",
        "logprob_abs_diff_max",
        "prob_pearson",
        "is_ess",
    }


async def test_a_bypass_run_compares_nothing(tmp_path):
    over = ["algorithm.rollout_correction.bypass_mode=true", f"trainer.run_dir={tmp_path}"]
    summary = await trainer.run.train(load_config(None, [*RUN, *over]))
    assert not any(k.startswith("mismatch") for r in _rows(tmp_path) for k in r)
    assert "mismatch" not in summary
