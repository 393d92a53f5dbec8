"""Does on-policy distillation teach? Two sittings of ``python -m trainer``:

::

    python benchmarks/distillation.py tiny [--steps 12]
    python benchmarks/distillation.py smollm2 [--teacher-run DIR] [--teacher-steps 25] [--steps 25]

``tiny``: the built-in tiny model learns from a teacher that is itself with its LM head scaled
by 4 (a sharper copy, written to a temporary folder), no task reward, the default batch:
``distill/reverse_kl`` per step, which should fall.

``smollm2`` (the issue's acceptance run, tens of minutes on two cores): the teacher is
SmolLM2-135M-Instruct trained by ``examples/smollm2_addition.yaml`` (25 steps, checkpointed)
and exported with ``ckpt export`` (``--teacher-run DIR`` reuses a run that has its checkpoint);
then ``examples/smollm2_distill_addition.yaml`` distills it into the base model with no task
reward. It prints the teacher's and the student's held-out accuracy (greedy and sampled) at
each eval, the reverse KL per step, the median step and teacher-scoring times and the peak
memory: the numbers of docs/algorithms.md#on-policy-distillation.

A benchmark, never a test: it asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def trainer(*args: str) -> None:
    """``python -m trainer ARGS`` from the project root; exits on a failed run."""
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT)
    if proc.returncode:
        sys.exit(f"python -m trainer {' '.join(args)} failed ({proc.returncode})")


def rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def sharper_copy(model_dir: Path, dst: Path, scale: float) -> Path:
    """``model_dir`` with its LM head scaled by ``scale``, written to ``dst``."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, dst)
    weights = next(dst.glob("*.safetensors"))
    state = load_file(weights)
    state["lm_head.weight"] = state["lm_head.weight"] * scale
    save_file(state, weights, metadata={"format": "pt"})
    return dst


def report(run_dir: Path, label: str) -> None:
    """The run's evals, reverse KL per step, median times and peak memory."""
    data = rows(run_dir)
    steps = [r for r in data if "timing/step" in r]
    print(f"\n{label} ({run_dir})")
    for r in data:
        if "eval/accuracy" in r:
            sampled = r.get("eval/sampled_accuracy")
            shown = "-" if sampled is None else f"{sampled:.3f}"
            print(
                f"  eval after step {r['step']}: greedy {r['eval/accuracy']:.3f}, sampled {shown}"
            )
    kl = [r["distill/reverse_kl"] for r in steps if "distill/reverse_kl" in r]
    if kl:
        print("  reverse KL per step: " + ", ".join(f"{v:.3f}" for v in kl))
    for key in ("timing/step", "timing/teacher_logprobs", "timing/generate"):
        values = [r[key] for r in steps if key in r]
        if values:
            print(f"  median {key}: {statistics.median(values):.2f} s")
    rss = [r["memory/peak_rss_gb"] for r in steps if "memory/peak_rss_gb" in r]
    if rss:
        print(f"  trainer peak RSS: {max(rss):.2f} GiB")


def tiny(steps: int, extra: list[str]) -> None:
    from engines.models import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        teacher = sharper_copy(build_tiny_model(), Path(tmp) / "teacher", 4.0)
        run_dir = Path(tmp) / "run"
        trainer(
            f"trainer.max_steps={steps}",
            "trainer.progress=false",
            "generator.sampling.max_tokens=8",
            f"algorithm.distillation.teacher_path={teacher}",
            f"trainer.run_dir={run_dir}",
            *extra,
        )
        report(run_dir, "tiny model, teacher = its LM head x 4")


def smollm2(steps: int, teacher_steps: int, teacher_run: Path | None, extra: list[str]) -> None:
    runs = ROOT / "runs"
    if teacher_run is None:
        teacher_run = runs / "distill_teacher"
        shutil.rmtree(teacher_run, ignore_errors=True)
        trainer(
            "--config",
            "examples/smollm2_addition.yaml",
            f"trainer.max_steps={teacher_steps}",
            f"trainer.ckpt_interval={teacher_steps}",
            f"trainer.eval_interval={max(1, teacher_steps // 2)}",
            "trainer.max_ckpts_to_keep=1",
            "trainer.progress=false",
            f"trainer.run_dir={teacher_run}",
        )
    teacher_model = runs / "distill_teacher_model"
    shutil.rmtree(teacher_model, ignore_errors=True)
    trainer("ckpt", "export", str(teacher_run), str(teacher_model))
    student_run = runs / "distill_student"
    shutil.rmtree(student_run, ignore_errors=True)
    trainer(
        "--config",
        "examples/smollm2_distill_addition.yaml",
        f"algorithm.distillation.teacher_path={teacher_model}",
        f"trainer.max_steps={steps}",
        "trainer.progress=false",
        f"trainer.run_dir={student_run}",
        *extra,
    )
    report(teacher_run, "teacher: examples/smollm2_addition.yaml")
    report(student_run, "student: examples/smollm2_distill_addition.yaml")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("which", choices=("tiny", "smollm2"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--teacher-run", type=Path, default=None)
    parser.add_argument("--teacher-steps", type=int, default=25)
    parser.add_argument("extra", nargs="*", help="key=value overrides of the student's run")
    args = parser.parse_intermixed_args()
    if args.which == "tiny":
        tiny(args.steps or 12, args.extra)
    else:
        smollm2(args.steps or 25, args.teacher_steps, args.teacher_run, args.extra)


if __name__ == "__main__":
    main()
