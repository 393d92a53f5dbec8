"""The default run on a machine shared with busy processes: its wall time idle, beside one busy
process and beside two (``python -c "while True: pass"``), back to back, as ratios to idle.

    .venv/bin/python benchmarks/shared_machine.py [--rounds 3] [--steps 200] [--repo DIR]

Each round runs the three cases in turn (idle, one busy, two busy), so the machine's own
drift falls on all three. ``--repo`` runs another checkout's trainer (its ``.venv``), to
compare a version before a change with this one in the same sitting. Prints one line per run
(wall time, median step and stage times, the last 20 steps' mean reward) and a table of
medians with the ratios to idle. Measured, never a test: docs/performance.md has what it
printed.
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

ROOT = Path(__file__).resolve().parent.parent
BUSY = "while True: pass"


def run(repo: Path, steps: int, busy: int, run_dir: Path) -> dict[str, float]:
    spinners = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
    try:
        started = time.monotonic()
        subprocess.run(
            [
                str(repo / ".venv" / "bin" / "python"),
                "-m",
                "trainer",
                f"trainer.max_steps={steps}",
                f"trainer.run_dir={run_dir}",
                "trainer.progress=false",
            ],
            cwd=repo,
            check=True,
            capture_output=True,
        )
        wall = time.monotonic() - started
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    def median_ms(key: str) -> float:
        return 1000 * statistics.median(r[key] for r in rows if key in r)

    return {
        "wall_s": wall,
        "step_ms": median_ms("timing/step"),
        "generate_ms": median_ms("timing/generate"),
        "train_ms": median_ms("timing/train_critic_and_policy"),
        "reward_last20": statistics.mean(r["reward/mean"] for r in rows[-20:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repo", type=Path, default=ROOT)
    args = parser.parse_args()
    cases = {"idle": 0, "one busy": 1, "two busy": 2}
    results: dict[str, list[dict[str, float]]] = {c: [] for c in cases}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for case, busy in cases.items():
                out = run(args.repo.resolve(), args.steps, busy, Path(tmp) / f"{r}-{busy}")
                results[case].append(out)
                print(
                    f"round {r + 1} {case:8}: wall {out['wall_s']:6.1f} s, step "
                    f"{out['step_ms']:5.0f} ms (generate {out['generate_ms']:.0f}, train "
                    f"{out['train_ms']:.0f}), reward(last 20) {out['reward_last20']:.3f}",
                    flush=True,
                )
    idle = statistics.median(o["wall_s"] for o in results["idle"])
    print(f"\n{args.repo}: median of {args.rounds} rounds, {args.steps} steps")
    print("| case | wall | ratio to idle | median step | rewards (last 20) |")
    print("|---|---|---|---|---|")
    for case, outs in results.items():
        wall = statistics.median(o["wall_s"] for o in outs)
        step = statistics.median(o["step_ms"] for o in outs)
        rewards = ", ".join(f"{o['reward_last20']:.3f}" for o in outs)
        print(f"| {case} | {wall:.1f} s | {wall / idle:.2f}x | {step:.0f} ms | {rewards} |")


if __name__ == "__main__":
    main()
