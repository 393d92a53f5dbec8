"""How late a hung step is reported, and how long the teardown after it takes.

Runs ``python -m trainer trainer.max_steps=3 trainer.step_timeout_s=BUDGET
faults=forward_backward:hang@2`` a few times (a worker thread really blocked in
forward_backward) and reports, per run: the overshoot (the error's elapsed minus the budget),
the teardown (engine servers and workers stopped after the error, from the run's log), and
the whole command's wall time. Usage: ``python benchmarks/step_timeout_overshoot.py [RUNS] [BUDGET]``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: The run's log keeps the error's repr: StepTimeoutError(step, budget_s, elapsed_s, stage, op)
ELAPSED = re.compile(r"run failed: StepTimeoutError\(\d+, [\d.]+, ([\d.]+),")
TEARDOWN = re.compile(r"teardown after failure took ([\d.]+)s")


def main() -> None:
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    budget = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
    print(f"{'run':>3} {'overshoot_s':>11} {'teardown_s':>10} {'wall_s':>7}  last stderr line")
    for i in range(runs):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.monotonic()
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "trainer",
                    "trainer.max_steps=3",
                    f"trainer.step_timeout_s={budget:g}",
                    "faults=forward_backward:hang@2",
                    f"trainer.run_dir={tmp}",
                    "trainer.progress=false",
                ],
                capture_output=True,
                text=True,
            )
            wall = time.monotonic() - t0
            last = proc.stderr.strip().splitlines()[-1]
            log = (Path(tmp) / "train.log").read_text()
            elapsed = ELAPSED.search(log)
            teardown = TEARDOWN.search(log)
            over = float(elapsed[1]) - budget if elapsed else float("nan")
            down = float(teardown[1]) if teardown else float("nan")
            print(f"{i:>3} {over:>11.3f} {down:>10.2f} {wall:>7.1f}  {last[:100]}")


if __name__ == "__main__":
    main()
