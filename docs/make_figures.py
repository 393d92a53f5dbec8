"""The README's step timeline, drawn from a run's ``metrics.jsonl`` as plain SVG (no plotting library).

    .venv/bin/python docs/make_figures.py RUN_DIR [--out docs/images]

writes ``step_timeline.svg``: one step's stages in order, each as long as its mean
``timing/<stage>`` over the run, under the deadlines that bound them. The README's reward
curve is ``python -m trainer plot``'s ``reward.png``. Both come from the default run
(``.venv/bin/python -m trainer trainer.run_dir=runs/default``); redraw them when its numbers
change.
"""

from __future__ import annotations

import argparse
import json
import statistics
from html import escape
from pathlib import Path

from trainer.vocabulary import STAGES as ALL_STAGES

#: The stages of a synchronous step, in step order (eval and the fully-async stages left out;
#: teacher_logprobs is drawn where a distillation run timed it).
STAGES = tuple(
    s for s in ALL_STAGES if s not in ("eval", "wait_for_generation_buffer", "run_training")
)
COLORS = ("#4c78a8", "#f58518", "#9d755d", "#54a24b", "#e45756", "#b279a2", "#72b7b2")
FONT = 'font-family="sans-serif" font-size="12"'


def read_steps(run_dir: Path) -> list[dict]:
    """The per-step rows of a run (eval lines, which carry no ``reward/mean``, left out)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("reward/mean") is not None]


def _svg(width: int, height: int, body: list[str]) -> str:
    return "\n".join(
        [
            f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}">',
            f'<rect width="{width}" height="{height}" fill="white"/>',
            *body,
            "</svg>",
            "",
        ]
    )


def _text(x: float, y: float, s: str, anchor: str = "start", extra: str = "") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}" {FONT} {extra}>{escape(s)}</text>'


def stage_means(rows: list[dict]) -> dict[str, float]:
    """Mean seconds of each stage over the steps that ran it (step 1 left out: cold start)."""
    warm = rows[1:] or rows
    out = {}
    for stage in STAGES:
        values = [r[f"timing/{stage}"] for r in warm if f"timing/{stage}" in r]
        if values:
            out[stage] = statistics.fmean(values)
    return out


#: The operations each stage awaits (the ``operation=`` a timeout in that stage names).
OPERATIONS = {
    "generate": "generate, env_step (your generator's rollouts)",
    "fwd_logprobs_values_reward": "forward (old and reference logprobs)",
    "teacher_logprobs": "teacher_logprobs (algorithm.distillation)",
    "compute_advantages": "(no named operation)",
    "train_critic_and_policy": "forward_backward, optim_step",
    "save_checkpoints": "save_checkpoint (with trainer.ckpt_interval)",
    "sync_weights": "/pause, broadcast_to_inference_engines, /resume",
}


def step_timeline(rows: list[dict], title: str) -> str:
    """One step's stages end to end under the budgets that bound them, and a legend.

    Bar widths are the stages' ``stage_means`` (at least 6 px each); brackets mark
    ``trainer.step_timeout_s`` over the step and ``trainer.weight_sync_timeout_s`` over
    ``sync_weights``; the legend names each stage's operations.
    """
    means = stage_means(rows)
    w, left, right = 760, 16, 16
    total = sum(means.values()) or 1.0
    min_px, pw = 6.0, w - left - right
    scale = (pw - min_px * len(means)) / total
    body = [_text(w / 2, 22, title, "middle", 'font-weight="bold"')]
    x, bar_y, bar_h = float(left), 104, 30
    spans: dict[str, tuple[float, float]] = {}
    for stage, secs in means.items():
        width = min_px + secs * scale
        spans[stage] = (x, x + width)
        color = COLORS[STAGES.index(stage)]
        body.append(
            f'<rect x="{x:.1f}" y="{bar_y}" width="{width:.1f}" height="{bar_h}" fill="{color}"/>'
        )
        x += width

    def bracket(x0: float, x1: float, y: float, label: str, color: str, anchor: str) -> None:
        body.append(
            f'<path d="M{x0:.1f},{y + 8} V{y} H{x1:.1f} V{y + 8}" fill="none" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        lx = {"start": x0, "middle": (x0 + x1) / 2, "end": x1}[anchor]
        body.append(_text(lx, y - 6, label, anchor, f'fill="{color}"'))

    bracket(
        left,
        x,
        54,
        f"trainer.step_timeout_s bounds the whole step ({total:.2f}s here): "
        "StepTimeoutError(step, stage, operation)",
        "#333",
        "middle",
    )
    if "sync_weights" in spans:
        s0, s1 = spans["sync_weights"]
        bracket(s0, s1, 86, "trainer.weight_sync_timeout_s: WeightSyncTimeoutError", "#a33", "end")
    y = bar_y + bar_h + 28
    for stage, secs in means.items():
        color = COLORS[STAGES.index(stage)]
        body.append(f'<rect x="{left}" y="{y - 10}" width="12" height="12" fill="{color}"/>')
        body.append(_text(left + 18, y, stage))
        body.append(_text(left + 262, y, f"{secs:.3f}s", "end"))
        body.append(_text(left + 276, y, OPERATIONS[stage], extra='fill="#555"'))
        y += 18
    notes = (
        "Each control-plane call (/pause, /resume, ...) is also bounded by "
        "engine.control_plane_timeout_s.",
        "eval (every trainer.eval_interval steps) runs after the step, under its own "
        "trainer.step_timeout_s.",
        "Widths: mean seconds per stage over the run, every stage at least 6 px.",
    )
    for note in notes:
        body.append(_text(left, y + 8, note, extra='fill="#555"'))
        y += 16
    return _svg(w, y + 8, body)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "images")
    args = parser.parse_args(argv)
    rows = read_steps(args.run_dir)
    if not rows:
        parser.error(f"{args.run_dir}/metrics.jsonl has no step rows")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_timeline.svg").write_text(
        step_timeline(rows, "One step of the default run, stage by stage, and its deadlines")
    )
    print(f"wrote {args.out / 'step_timeline.svg'}")


if __name__ == "__main__":
    main()
