"""The default task's step against real vLLM on the CPU and against the reference engine, in one sitting.

::

    .venv-vllm/bin/python benchmarks/vllm_step.py [--steps 60] [--rounds 2] [-- key=value ...]

Needs ``.venv-vllm`` (``bash setup.sh --vllm``). Runs ``python -m trainer`` (this Python, so
both engines meet the same torch) for ``--steps`` steps of the default task with
``sync.transport=gloo``, once per arm and round, arms interleaved (so the machine's noise
hits every arm alike):

- ``reference``: ``engine.backend=local``, the reference engine;
- ``vllm-spin-1s``: ``engine.backend=vllm`` with vLLM's own message-queue spin (its readers
  busy-spin 1 s after every message: ``TRAINER_VLLM_BUSY_LOOP_S=1``, vLLM's default);
- ``vllm``: ``engine.backend=vllm`` as the launcher starts it (its default spin, see
  ``engines.vllm.serve``);

and any ``key=value`` given after ``--`` in every arm. For each run it reads ``metrics.jsonl``:
the median of ``timing/step`` and ``timing/generate`` over the steps after the first 5 (the
first pay for warm-up), the train stage and the sync; and the run's wall time (vLLM's start
included). Prints one table, then the ratio of each vLLM arm's step to the reference's
(issue 27's goal: at most 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP_STEPS = 5
STAGES = ("step", "generate", "train_critic_and_policy", "sync_weights")

#: name -> (overrides, environment)
ARMS: dict[str, tuple[list[str], dict[str, str]]] = {
    "reference": (["engine.backend=local"], {}),
    "vllm-spin-1s": (["engine.backend=vllm"], {"TRAINER_VLLM_BUSY_LOOP_S": "1"}),
    "vllm": (["engine.backend=vllm"], {}),
}


def run(arm: str, steps: int, overrides: list[str], run_dir: Path) -> dict[str, float]:
    arm_overrides, arm_env = ARMS[arm]
    cmd = [sys.executable, "-m", "trainer", "sync.transport=gloo", "trainer.progress=false"]
    cmd += [*arm_overrides, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}"]
    cmd += overrides
    env = {**os.environ, **arm_env}
    if arm != "vllm-spin-1s":
        env.pop("TRAINER_VLLM_BUSY_LOOP_S", None)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{arm} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    later = rows[WARMUP_STEPS:] or rows
    out = {s: statistics.median(r[f"timing/{s}"] for r in later) for s in STAGES}
    out["wall"] = wall
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument(
        "--arms", default=",".join(ARMS), help="comma-separated, of " + ", ".join(ARMS)
    )
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args()
    arms = args.arms.split(",")
    results: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for arm in arms:
                out = run(arm, args.steps, args.overrides, Path(tmp) / f"{arm}-{r}")
                results[arm].append(out)
                print(
                    f"round {r + 1} {arm}: step {out['step']:.3f}s wall {out['wall']:.0f}s",
                    flush=True,
                )
    print(
        f"\n{args.steps} steps x {args.rounds} rounds, medians of steps {WARMUP_STEPS + 1}+ "
        f"(seconds; each cell: the median over rounds), {os.cpu_count()} cores"
    )
    header = ["arm", *STAGES, "wall"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    medians = {}
    for arm in arms:
        cells = {k: statistics.median(o[k] for o in results[arm]) for k in (*STAGES, "wall")}
        medians[arm] = cells
        print(
            f"| {arm} | "
            + " | ".join(f"{cells[k]:.3f}" for k in STAGES)
            + f" | {cells['wall']:.0f} |"
        )
    if "reference" in medians:
        ref = medians["reference"]["step"]
        for arm in arms:
            if arm != "reference":
                print(f"{arm}: step {medians[arm]['step'] / ref:.1f}x the reference's")


if __name__ == "__main__":
    main()
