"""``python -m trainer plot RUN_DIR [RUN_DIR...] [--out DIR]``: PNGs of runs, side by side.

Reads each run's ``metrics.jsonl`` (the source of truth) and writes, into ``--out`` (default
``FIRST_RUN_DIR/plots``):

- ``reward.png``, ``loss.png``, ``kl.png``, ``loop_stall.png``, ``weight_sync.png``,
  ``mismatch_logprob.png``, ``mismatch_pearson.png``, ``mismatch_ess.png``: one line per run
  against the step (``reward/mean``, ``policy/loss``, ``policy/kl`` or else
  ``policy/approx_kl``, ``loop/max_stall_ms``, ``sync/last_weight_sync_seconds``, and the
  mismatch diagnostics ``mismatch/logprob_abs_diff_mean``, ``mismatch/prob_pearson``,
  ``mismatch/is_ess``);
- ``eval.png``: each run's eval lines against the step: greedy ``eval/reward_mean`` and,
  where recorded, ``eval/sampled_reward_mean`` (step 0: before training);
- ``step_time.png``: each run's step time stacked by stage (``timing/<stage>`` in the
  order of DESIGN 4.3), one panel per run;
- ``overview.png``: all of the above on one figure.

A metric a run did not record is left out of that run's lines (a panel with no data says
so; ``eval.png`` is not written for runs without an eval). A line that is 0 at every step
says so in its legend (the KL panel of a run with one optimizer step per batch and no KL
loss is 0 by construction), and a run's line identical to another's, hidden under it, says
which. Each stage has one colour in every run's ``step_time`` panel. Needs matplotlib, an
optional extra: ``pip install 'trainer[plot]'``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from trainer.metrics._logger import KL_METRICS
from trainer.vocabulary import STAGES

__all__ = ["EVAL_METRICS", "LINE_PLOTS", "plot_main", "plot_runs", "read_evals", "read_steps"]

#: file stem -> (title, y label, metric keys tried in order).
LINE_PLOTS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "reward": ("Reward (mean per step)", "reward", ("reward/mean",)),
    "loss": ("Policy loss", "loss", ("policy/loss",)),
    "kl": ("KL to the reference / old policy", "KL", KL_METRICS),
    "loop_stall": ("Longest event-loop stall", "ms", ("loop/max_stall_ms",)),
    "weight_sync": ("Weight sync time", "seconds", ("sync/last_weight_sync_seconds",)),
    "mismatch_logprob": (
        "Engine vs trainer: mean |logprob difference| of the sampled tokens",
        "|logprob diff|",
        ("mismatch/logprob_abs_diff_mean",),
    ),
    "mismatch_pearson": (
        "Engine vs trainer: correlation of the sampled tokens' probabilities",
        "Pearson r",
        ("mismatch/prob_pearson",),
    ),
    "mismatch_ess": (
        "Importance weights' effective sample size (normalized)",
        "ESS / n",
        ("mismatch/is_ess",),
    ),
}

#: The eval panel's metrics: label -> key.
EVAL_METRICS = {"greedy": "eval/reward_mean", "sampled": "eval/sampled_reward_mean"}


def read_steps(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step rows of ``run_dir/metrics.jsonl`` (eval rows left out), by step.

    A step row restored from its checkpoint on resume (no timings) is kept; its stages
    draw as 0 s.

    ``FileNotFoundError`` when the run has no metrics.
    """
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if "reward/mean" in r), key=lambda r: r["step"])


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The eval rows of ``run_dir/metrics.jsonl`` (they carry ``eval/reward_mean``), by step."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return sorted((r for r in rows if "eval/reward_mean" in r), key=lambda r: r["step"])


def _eval_panel(ax: Axes, evals: dict[str, list[dict[str, Any]]]) -> int:
    """Greedy and sampled eval reward per run; the number of lines drawn."""
    drawn = 0
    for label, rows in evals.items():
        for kind, metric in EVAL_METRICS.items():
            points = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", label=f"{label} {kind}")
                drawn += 1
    ax.set_title("Eval reward (held-out or data.eval prompts)")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return drawn


def _label(run_dir: Path, runs: Sequence[Path]) -> str:
    names = [r.name for r in runs]
    return run_dir.name if names.count(run_dir.name) == 1 else str(run_dir)


#: The legend's note for a line that is 0 at every step.
ALL_ZERO = "0 at every step"
#: Where a KL line is 0 by construction: why.
KL_ZERO_WHY = "one optimizer step per batch, no KL loss"


def _line_panel(ax: Axes, key: str, runs: dict[str, list[dict[str, Any]]]) -> int:
    """Draw one line per run; the number of lines drawn."""
    title, ylabel, metrics = LINE_PLOTS[key]
    drawn = 0
    seen: dict[tuple[tuple[float, float], ...], str] = {}  # a drawn line -> its run
    for label, rows in runs.items():
        metric = next((m for m in metrics if any(r.get(m) is not None for r in rows)), None)
        if metric is None:
            continue
        points = [(r["step"], r[metric]) for r in rows if r.get(metric) is not None]
        # where a panel falls back between metrics, say which one each line is
        name = f"{label} ({metric})" if len(metrics) > 1 else label
        notes = []
        if all(v == 0 for _, v in points):
            notes.append(f"{ALL_ZERO}: {KL_ZERO_WHY}" if key == "kl" else ALL_ZERO)
        twin = seen.setdefault(tuple(points), label)
        if twin != label:
            notes.append(f"identical to {twin}, drawn over it")
        if notes:
            name = f"{name}: {'; '.join(notes)}"
        style = "--" if twin != label else "-"
        ax.plot(*zip(*points), style, marker="." if len(points) < 30 else None, label=name)
        drawn += 1
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    return drawn


def _stacked_panel(ax: Axes, label: str, rows: list[dict[str, Any]]) -> int:
    """Step time stacked by stage for one run; the number of stages drawn."""
    stages = [s for s in STAGES if any(f"timing/{s}" in r for r in rows)]
    steps = [r["step"] for r in rows]
    layers = [[r.get(f"timing/{s}") or 0.0 for r in rows] for s in stages]
    if stages:  # a stage's colour is its place in STAGES, the same in every run's panel
        colours = [f"C{STAGES.index(s) % 10}" for s in stages]
        ax.stackplot(steps, layers, labels=stages, colors=colours)
        ax.legend(fontsize="x-small", loc="upper left")
    ax.set_title(f"Step time by stage: {label}")
    ax.set_xlabel("step")
    ax.set_ylabel("seconds")
    return len(stages)


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


def plot_runs(run_dirs: Sequence[Path], out_dir: Path) -> dict[str, int]:
    """Write the PNGs of the module docstring for ``run_dirs`` into ``out_dir``.

    Returns what each file shows: PNG name -> lines (or stacked stages) drawn in it.
    ``FileNotFoundError`` for a run without ``metrics.jsonl``.
    """
    runs = {_label(d, run_dirs): read_steps(d) for d in run_dirs}
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn: dict[str, int] = {}
    for key in LINE_PLOTS:
        fig = Figure(figsize=(8, 4.5))
        drawn[f"{key}.png"] = _line_panel(fig.add_subplot(), key, runs)
        _save(fig, out_dir / f"{key}.png")
    evals = {_label(d, run_dirs): read_evals(d) for d in run_dirs}
    if any(evals.values()):  # no eval.png for runs without an eval
        fig = Figure(figsize=(8, 4.5))
        drawn["eval.png"] = _eval_panel(fig.add_subplot(), evals)
        _save(fig, out_dir / "eval.png")
    fig = Figure(figsize=(8, 3.5 * len(runs)))
    drawn["step_time.png"] = sum(
        _stacked_panel(fig.add_subplot(len(runs), 1, i + 1), label, rows)
        for i, (label, rows) in enumerate(runs.items())
    )
    _save(fig, out_dir / "step_time.png")
    n_rows = (len(LINE_PLOTS) + 1 + len(runs) + 1) // 2
    overview = Figure(figsize=(16, 4 * n_rows))
    for i, key in enumerate(LINE_PLOTS):
        _line_panel(overview.add_subplot(n_rows, 2, i + 1), key, runs)
    _eval_panel(overview.add_subplot(n_rows, 2, len(LINE_PLOTS) + 1), evals)
    for j, (label, rows) in enumerate(runs.items()):
        _stacked_panel(overview.add_subplot(n_rows, 2, len(LINE_PLOTS) + j + 2), label, rows)
    drawn["overview.png"] = len(LINE_PLOTS) + 1 + len(runs)
    _save(overview, out_dir / "overview.png")
    return drawn


def plot_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer plot", description=__doc__)
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    parser.add_argument("--out", type=Path, default=None, help="default: FIRST_RUN_DIR/plots")
    args = parser.parse_args(argv)
    out = args.out or args.run_dirs[0] / "plots"
    try:
        drawn = plot_runs(args.run_dirs, out)
    except FileNotFoundError as exc:
        print(f"plot: {exc.filename}: no such file (is it a run directory?)", file=sys.stderr)
        return 2
    for name in drawn:
        print(out / name)
    if "eval.png" not in drawn:
        print("plot: no eval in these runs (trainer.eval_interval=0): no eval.png", file=sys.stderr)
    return 0
