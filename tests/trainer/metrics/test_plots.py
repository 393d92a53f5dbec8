"""``python -m trainer plot`` draws every run on one figure per metric, stacked step times per
run, and PNGs a reader can open."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from matplotlib.image import imread  # the `plot` extra: setup.sh installs it for the tests

from tests.e2e.helpers import REPO
from trainer.metrics.plots import LINE_PLOTS, plot_runs


def _write_run(run_dir: Path, steps: int, *, slope: float, with_kl: bool) -> Path:
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(1, steps + 1):
        row = {
            "step": step,
            "reward/mean": slope * step,
            "policy/loss": 1.0 / step,
            "policy/approx_kl": 0.01 * step,
            "timing/generate": 1.0,
            "timing/fwd_logprobs_values_reward": 0.2,
            "timing/train_critic_and_policy": 0.5,
            "timing/sync_weights": 0.1,
            "timing/step": 1.8,
            "loop/max_stall_ms": 5.0 + step,
            "sync/last_weight_sync_seconds": 0.05,
            "mismatch/logprob_abs_diff_mean": 0.01 + slope * step,
            "mismatch/prob_pearson": 1.0 - slope * step,
            "mismatch/is_ess": 1.0 - slope * step / 2,
        }
        if with_kl:
            row["policy/kl"] = 0.02 * step
        rows.append(row)
        if step % 2 == 0:
            ev = {"step": step, "eval/reward_mean": 0.5, "timing/eval": 0.3}
            if with_kl:  # one of the two runs also samples its eval
                ev["eval/sampled_reward_mean"] = 0.1 * step
            rows.append(ev)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def _plot_area_is_drawn(png: Path) -> None:
    image = imread(png)
    height, width = image.shape[:2]
    assert width >= 600 and height >= 300, (png.name, width, height)
    # more than background and axes: lines or filled areas in colour
    rgb = image[..., :3]
    coloured = ((rgb.max(axis=-1) - rgb.min(axis=-1)) > 0.2).mean()
    assert coloured > 0.001, f"{png.name} has no coloured pixels: empty axes?"


def test_two_runs_share_each_figure_and_every_png_opens_with_drawn_axes(tmp_path):
    a = _write_run(tmp_path / "a", 12, slope=0.05, with_kl=True)
    b = _write_run(tmp_path / "b", 8, slope=0.02, with_kl=False)
    drawn = plot_runs([a, b], tmp_path / "plots")
    assert {f"{k}.png" for k in LINE_PLOTS} | {
        "eval.png",
        "step_time.png",
        "overview.png",
    } == set(drawn)
    assert drawn["eval.png"] == 3  # greedy for both runs, sampled for the one that sampled
    for key in LINE_PLOTS:
        assert drawn[f"{key}.png"] == 2, key  # one line per run, on one figure
    assert drawn["step_time.png"] == 2 * 4  # four stages stacked, for each run
    for name in drawn:
        _plot_area_is_drawn(tmp_path / "plots" / name)


def test_the_cli_writes_into_the_first_runs_plots_folder_and_names_each_file(tmp_path):
    run = _write_run(tmp_path / "run", 5, slope=0.1, with_kl=False)
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "plot", str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    written = [Path(line) for line in out.stdout.split()]
    assert {p.name for p in written} >= {"reward.png", "step_time.png", "overview.png"}
    assert all(p.parent == run / "plots" and p.stat().st_size > 1000 for p in written)
    missing = subprocess.run(
        [sys.executable, "-m", "trainer", "plot", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr


def test_a_line_that_hides_or_says_nothing_says_so_and_stage_colours_hold(tmp_path):
    from matplotlib.figure import Figure

    from trainer.metrics.plots import _line_panel, _stacked_panel

    # the default run's KL panel: approx_kl is 0 at every step by construction
    flat = [{"step": s, "policy/approx_kl": 0.0, "reward/mean": 0.1 * s} for s in (1, 2, 3)]
    same = [dict(r) for r in flat]
    other = [{"step": s, "policy/approx_kl": 0.01 * s, "reward/mean": 0.2} for s in (1, 2, 3)]
    ax = Figure().add_subplot()
    _line_panel(ax, "kl", {"a": flat, "b": same, "c": other})
    labels = ax.get_legend_handles_labels()[1]
    assert (
        labels[0]
        == "a (policy/approx_kl): 0 at every step: one optimizer step per batch, no KL loss"
    )
    assert labels[1].endswith("; identical to a, drawn over it")
    assert labels[2] == "c (policy/approx_kl)"
    ax = Figure().add_subplot()
    _line_panel(ax, "reward", {"a": flat, "c": other})
    assert ax.get_legend_handles_labels()[1] == ["a", "c"]
    # a stage a run did not have does not shift the others' colours
    with_all = [{"step": 1, "timing/generate": 1.0, "timing/sync_weights": 0.1}]
    without = [{"step": 1, "timing/sync_weights": 0.1}]
    colours = []
    for rows in (with_all, without):
        ax = Figure().add_subplot()
        _stacked_panel(ax, "x", rows)
        handles, labels = ax.get_legend_handles_labels()
        colours.append(dict(zip(labels, (tuple(h.get_facecolor()[0]) for h in handles))))
    assert colours[0]["sync_weights"] == colours[1]["sync_weights"]


def test_runs_without_an_eval_get_no_empty_eval_png(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "reward/mean": 0.1 * s, "timing/generate": 1.0} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    drawn = plot_runs([run], tmp_path / "plots")
    assert "eval.png" not in drawn and not (tmp_path / "plots" / "eval.png").exists()
    assert "reward.png" in drawn
