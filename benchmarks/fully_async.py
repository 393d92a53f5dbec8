"""Fully-async against synchronous training where rollouts wait on a slow environment.

::

    python benchmarks/fully_async.py [--steps 30] [--env-delay-s auto] [-- key=value ...]

The workload (issue 17's): every trajectory makes one call to an HTTP environment service
(``examples.http_env``, in its own process) that answers after ``--env-delay-s`` seconds,
about as long as a training step takes. Generation then mostly waits, so the rollouts and
the training do not compete for this machine's two cores, and the ideal fully-async speed-up
is 2x: a synchronous step takes rollout + training, a fully-async one the larger of the two.

In one sitting:

1. ``auto`` delay: a short synchronous run with a 0.01 s environment measures the training
   part of a step (the median of ``fwd_logprobs_values_reward`` + ``compute_advantages`` +
   ``train_critic_and_policy`` + ``sync_weights``); the environment then answers after that
   long;
2. the synchronous run and the fully-async run (``max_staleness_steps=1``: the next step's
   rollouts overlap this step's training; ``num_parallel_workers`` = the batch's prompts),
   each ``python -m trainer`` in a child process, back to back.

Throughput is trained samples per second over the steady steps (the first 20% dropped):
``train_batch_size * n_samples_per_prompt / median(timing/step)``. Prints both, their
ratio (the goal: >= 1.8x), and the fully-async run's staleness and idle ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

TRAIN_STAGES = (
    "fwd_logprobs_values_reward",
    "compute_advantages",
    "train_critic_and_policy",
    "sync_weights",
)


def start_env(delay_s: float) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "examples.http_env", "--port", "0", "--turns", "1"]
    proc = subprocess.Popen(
        [*cmd, "--delay-s", str(delay_s)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def run(env_delay_s: float, steps: int, extra: list[str], run_dir: Path) -> list[dict]:
    env, url = start_env(env_delay_s)
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "trainer",
                "trainer.progress=false",
                "engine.backend=inprocess",
                "generator.cls=examples.http_env:HttpEnvGenerator",
                f"generator.kwargs.env_url={url}",
                "generator.kwargs.env_timeout_s=30",
                f"trainer.max_steps={steps}",
                f"trainer.run_dir={run_dir}",
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    finally:
        env.kill()
        env.wait()
        assert env.stdout is not None
        env.stdout.close()
    if done.returncode != 0:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows[len(rows) // 5 :]  # the steady steps


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--env-delay-s", default="auto")
    parser.add_argument("overrides", nargs="*", help="key=value for both runs (after --)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        if args.env_delay_s == "auto":
            probe = run(0.01, 10, ["trainer.strategy=sync", *args.overrides], tmp_path / "probe")
            delay = sum(median(probe, f"timing/{s}") for s in TRAIN_STAGES)
        else:
            delay = float(args.env_delay_s)
        print(f"environment delay: {delay:.3f} s per call (one call per trajectory)")
        sync = run(delay, args.steps, ["trainer.strategy=sync", *args.overrides], tmp_path / "s")
        fully = run(
            delay,
            args.steps,
            [
                "trainer.strategy=fully_async",
                "trainer.fully_async.max_staleness_steps=1",
                "generator.num_parallel_workers=16",
                *args.overrides,
            ],
            tmp_path / "a",
        )
        n = yaml.safe_load((tmp_path / "s" / "config.yaml").read_text())["generator"][
            "n_samples_per_prompt"
        ]
    samples = len(sync[0]["data/example_index"]) * n
    t_sync, t_async = median(sync, "timing/step"), median(fully, "timing/step")
    print(f"{'':22}{'sync':>10}{'fully_async':>14}")
    print(f"{'step (median, s)':22}{t_sync:>10.3f}{t_async:>14.3f}")
    for stage in ("generate", "wait_for_generation_buffer", *TRAIN_STAGES):
        print(
            f"{stage[:22]:22}{median(sync, f'timing/{stage}'):>10.3f}"
            f"{median(fully, f'timing/{stage}'):>14.3f}"
        )
    print(f"{'samples / s':22}{samples / t_sync:>10.1f}{samples / t_async:>14.1f}")
    print(f"speed-up: {t_sync / t_async:.2f}x (goal >= 1.8x, ideal 2x)")
    print(
        "fully_async: staleness mean {:.2f} max {:.0f}; generator idle {:.2f}; trainer idle "
        "{:.2f}; dropped {:.0f}".format(
            statistics.fmean(r["async/staleness_mean"] for r in fully),
            max(r["async/staleness_max"] for r in fully),
            statistics.fmean(r["async/generator_idle_ratio"] for r in fully),
            statistics.fmean(r["async/trainer_idle_ratio"] for r in fully),
            sum(r["async/dropped_stale"] for r in fully),
        )
    )


if __name__ == "__main__":
    main()
