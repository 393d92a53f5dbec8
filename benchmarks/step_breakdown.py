"""Where a default step's time goes, against the cheapest possible generation of the same batch.

::

    python benchmarks/step_breakdown.py [--steps 30] [--repeats 5] [-- key=value ...]

Runs, in one sitting (so the machine's noise hits both alike):

1. the default run, exactly as a user starts it (``python -m trainer`` in a child process,
   with ``trainer.max_steps`` and any ``key=value`` given after ``--``), then reads its
   ``metrics.jsonl``: the median of each ``timing/*`` stage over the steps after the first
   (the first pays for warm-up), the run's wall time, and the mean reward of its last 20%
   of steps;
2. the ceiling: one batched in-process ``model.generate`` of the same shape (the first
   ``train_batch_size`` prompts of the task, ``n_samples_per_prompt`` samples each, at most
   ``max_tokens`` new tokens, sampling at the configured temperature) on the same model, with
   one torch thread, as the engine server has; ``--repeats`` calls just before the run and
   as many just after it, and the median of them all (so a machine whose load changes during
   the run is measured on both sides of it).

Prints a table of stage medians and the ratio of the ``generate`` stage to the ceiling
(issue 13's goal: at most 2x, and a step of at most 0.2 s on the two-core dev machine).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engines.models import load_tokenizer, resolve_model_path  # noqa: E402
from trainer.config import load_config  # noqa: E402
from trainer.data import load_datasets  # noqa: E402


def run_default(steps: int, overrides: list[str], run_dir: Path) -> tuple[float, list[dict]]:
    """``python -m trainer`` for ``steps`` steps: (wall seconds, the metrics lines)."""
    cmd = [
        sys.executable,
        "-m",
        "trainer",
        f"trainer.max_steps={steps}",
        f"trainer.run_dir={run_dir}",
        *overrides,
    ]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return wall, [m for m in lines if "timing/generate" in m]


def ceiling(overrides: list[str], repeats: int) -> list[float]:
    """Seconds of ``repeats`` batched ``model.generate`` calls of the default batch's shape."""
    from transformers import AutoModelForCausalLM

    cfg = load_config(None, overrides)
    model_dir = resolve_model_path(cfg.model.path)
    tok = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    examples = load_datasets(cfg.data, cfg.trainer.seed).train
    prompts = [
        tok.encode(ex.prompt, add_special_tokens=False)
        for ex in examples[: cfg.trainer.train_batch_size]
    ]
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    s = cfg.generator.sampling
    times = []
    with torch.no_grad():
        for _ in range(repeats + 1):  # the first call warms up
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=s.max_tokens,
                do_sample=s.temperature > 0,
                temperature=s.temperature if s.temperature > 0 else None,
                top_p=s.top_p,
                num_return_sequences=cfg.generator.n_samples_per_prompt,
                pad_token_id=pad,
            )
            times.append(time.perf_counter() - start)
    return times[1:]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("overrides", nargs="*", help="key=value for the run (after --)")
    args = parser.parse_args(argv)

    torch.set_num_threads(1)
    before = ceiling(args.overrides, args.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        wall, steps = run_default(args.steps, args.overrides, Path(tmp) / "run")
    ceiling_s = statistics.median(before + ceiling(args.overrides, args.repeats))

    timed = steps[1:] if len(steps) > 1 else steps
    stages = sorted({k for m in timed for k in m if k.startswith("timing/")})
    tail = steps[-max(1, len(steps) // 5) :]
    print(f"default run, {len(steps)} steps, {wall:.1f} s wall (startup included)")
    print(f"{'stage (median of steps 2..N)':<40}{'ms':>10}")
    for key in stages:
        values = [m[key] for m in timed if key in m]
        print(f"{key.removeprefix('timing/'):<40}{1000 * statistics.median(values):>10.1f}")
    generate = statistics.median(m["timing/generate"] for m in timed)
    print(f"{'ceiling: batched model.generate':<40}{1000 * ceiling_s:>10.1f}")
    print(f"generate / ceiling: {generate / ceiling_s:.2f}x")
    print(
        f"reward/mean over the last {len(tail)} steps: "
        f"{statistics.fmean(m['reward/mean'] for m in tail):.3f}"
    )


if __name__ == "__main__":
    main()
