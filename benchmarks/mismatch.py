"""Rollout corrections against staleness: the default task, fully-async, each correction.

::

    .venv/bin/python benchmarks/mismatch.py [--steps 200] [--staleness 0 1 2 4]
                                            [--corrections none tis ...] [-- key=value ...]

For each ``max_staleness_steps`` and each correction, one ``python -m trainer`` run of the
default task (``trainer.strategy=fully_async``, the in-process engine, ``--steps`` steps), back
to back in one sitting, in child processes. The corrections (docs/algorithms.md#rollout-corrections):

- ``none``: no correction (``algorithm.off_policy_correction=none``; above staleness 0 it
  needs ``algorithm.rollout_correction.allow_uncorrected=true``, which this passes);
- ``tis``: token TIS capped at 2 (the fully-async default, ``off_policy_correction=auto``);
- ``seq_is``: sequence-level TIS (``rollout_is=sequence``);
- ``token_rs`` / ``geometric`` / ``icepop``: the rejection masks (``rollout_rs=...``);
- ``bypass``: the rollout's logprobs as the old policy's (``bypass_mode=true``).

Printed as a Markdown table, one row per run: the reward of the first and last 20% of steps and
their ratio (the issue's bar for "learns": at least 2), the staleness the run saw
(``async/staleness_mean``), the importance weights' effective sample size
(``mismatch/is_ess``, mean over steps), the share of tokens a mask rejected
(``*rs_rejected_frac``, mean over steps) and the median step time. A benchmark, never a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: Each correction's overrides.
CORRECTIONS: dict[str, list[str]] = {
    "none": ["algorithm.off_policy_correction=none"],
    "tis": ["algorithm.off_policy_correction=auto"],
    "seq_is": [
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.rollout_is=sequence",
    ],
    "token_rs": [
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.rollout_rs=token",
    ],
    "geometric": [
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.rollout_rs=geometric",
    ],
    "icepop": [
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.rollout_rs=icepop",
    ],
    "bypass": [
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.bypass_mode=true",
    ],
}


def run(staleness: int, correction: str, steps: int, extra: list[str], run_dir: Path) -> list[dict]:
    overrides = list(CORRECTIONS[correction])
    if correction == "none" and staleness > 0:
        overrides.append("algorithm.rollout_correction.allow_uncorrected=true")
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "trainer.progress=false",
            "engine.backend=inprocess",
            "trainer.strategy=fully_async",
            f"trainer.fully_async.max_staleness_steps={staleness}",
            f"trainer.max_steps={steps}",
            f"trainer.run_dir={run_dir}",
            *overrides,
            *extra,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(
            f"{correction} at staleness {staleness} failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


def mean_of(rows: list[dict], suffix: str) -> float | None:
    """The mean over steps of the metric named ``suffix`` (or ending in ``/suffix``)."""
    values = [v for r in rows for k, v in r.items() if k == suffix or k.endswith("/" + suffix)]
    return statistics.fmean(values) if values else None


def row(staleness: int, correction: str, rows: list[dict]) -> str:
    fifth = max(len(rows) // 5, 1)
    first = statistics.fmean(r["reward/mean"] for r in rows[:fifth])
    last = statistics.fmean(r["reward/mean"] for r in rows[-fifth:])
    ratio = last / first if first > 0 else float("inf")
    cells = [
        str(staleness),
        correction,
        f"{first:.3f}",
        f"{last:.3f}",
        f"{ratio:.1f}",
        _fmt(mean_of(rows, "async/staleness_mean"), 2),
        _fmt(mean_of(rows, "is_ess"), 3),
        _fmt(mean_of(rows, "rs_rejected_frac"), 3),
        f"{statistics.median(r['timing/step'] for r in rows):.3f}",
    ]
    return "| " + " | ".join(cells) + " |"


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--staleness", type=int, nargs="+", default=[0, 1, 2, 4])
    parser.add_argument(
        "--corrections", nargs="+", default=list(CORRECTIONS), choices=list(CORRECTIONS)
    )
    parser.add_argument("overrides", nargs="*", help="key=value for every run (after --)")
    args = parser.parse_args()
    print(
        "| staleness | correction | reward first 20% | last 20% | last / first "
        "| staleness seen | ESS | rejected tokens | step (median, s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for staleness in args.staleness:
            for correction in args.corrections:
                run_dir = Path(tmp) / f"{correction}-{staleness}"
                rows = run(staleness, correction, args.steps, args.overrides, run_dir)
                print(row(staleness, correction, rows), flush=True)


if __name__ == "__main__":
    main()
