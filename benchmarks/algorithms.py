"""Does each algorithm learn the default task, and what does it add to a step?

::

    python benchmarks/algorithms.py [--steps 200] [--only NAME ...] [--mini-batches N]
                                    [-- key=value ...]

Runs ``python -m trainer`` (the default task and model, the local reference engines) once per
recipe below, back to back in one sitting, each in its own run directory, and prints one table
(the one in docs/algorithms.md): the mean reward of the first and last 20% of steps
(``summary.json``), whether it learned (last >= 2x first, the issue's bar), the mean step time,
the batches of prompts generated per step (dynamic sampling's rounds), the first and last
step's value of a feature's own metric (the entropy bonus's ``policy/entropy``, the KL in the
reward's ``reward/kl_penalty`` and ``reward/kl_coef``, DRO's ``policy/dro_penalty``)
and the time of the stages an algorithm changes (``timing/fwd_logprobs_values_reward``: the
critic's values; ``timing/compute_advantages``; ``timing/train_critic_and_policy``), medians over the steps after the first 20%), each as a
ratio to GRPO's in the same sitting: wall-clock times on a shared machine swing, ratios
within one sitting much less.

With one optimizer step per batch (the default) every token ratio is exactly 1, so PPO and
CISPO take the same gradient (GSPO differs by its aggregation only); ``--mini-batches 4``
gives each batch four optimizer steps (``trainer.policy_mini_batch_size``), so that from the
second on the ratios move and the losses differ.

A benchmark, never a test: it asserts nothing and takes minutes (about 40 s a recipe on two
idle cores).
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

#: name -> overrides. DAPO is clip-higher (the default 0.28), token-mean (the default), the
#: overlong shaping on the last 2 of the default task's 4-token budget and dynamic sampling.
RECIPES: dict[str, list[str]] = {
    "GRPO": [],
    "Dr. GRPO": [
        "algorithm.norm_adv_by_std=false",
        "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
    ],
    "RLOO": ["algorithm.advantage_estimator=rloo"],
    "PPO + GAE": ["algorithm.advantage_estimator=gae"],
    "REINFORCE++": ["algorithm.advantage_estimator=reinforce_plus_plus"],
    "REINFORCE++ baseline": ["algorithm.advantage_estimator=reinforce_plus_plus_baseline"],
    "GSPO": [
        "algorithm.policy_loss=gspo",
        "algorithm.clip_ratio_low=0.0003",
        "algorithm.clip_ratio_high=0.0004",
    ],
    "CISPO": ["algorithm.policy_loss=cispo"],
    "DAPO": [
        "algorithm.clip_ratio_high=0.28",
        "algorithm.loss_agg_mode=token-mean",
        "algorithm.overlong_buffer.len=2",
        "algorithm.dynamic_sampling.type=filter",
    ],
    # GRPO's own entropy, measured: a coefficient too small to move anything turns it on
    "GRPO, entropy measured": ["algorithm.entropy_coeff=1e-12"],
    "Entropy bonus": ["algorithm.entropy_coeff=0.01"],
    "Entropy bonus, 0.05": ["algorithm.entropy_coeff=0.05"],
    "KL in reward, fixed": ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.01"],
    "KL in reward, adaptive": [
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.kl_coef=0.01",
        "algorithm.kl_ctrl.target_kl=0.1",
        "algorithm.kl_ctrl.horizon=1000",
    ],
    "DRO": ["algorithm.policy_loss=dro"],
    "REINFORCE++, KL in reward": [
        "algorithm.advantage_estimator=reinforce_plus_plus",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.kl_coef=0.01",
    ],
}
#: The metrics of a feature the table's runs print at their last step, where a run has them.
FEATURE_METRICS = ("policy/entropy", "reward/kl_penalty", "reward/kl_coef", "policy/dro_penalty")
STAGES = ("fwd_logprobs_values_reward", "compute_advantages", "train_critic_and_policy")


def run(overrides: list[str], steps: int, run_dir: Path) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "trainer.progress=false",
            f"trainer.max_steps={steps}",
            f"trainer.run_dir={run_dir}",
            *overrides,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        sys.exit(f"run {overrides} failed:\n{done.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "timing/step" in r][max(1, steps // 5) :]
    for stage in STAGES:
        summary[stage] = statistics.median(r[f"timing/{stage}"] for r in steady)
    trained = [r for r in rows if "timing/step" in r]
    summary["features"] = {
        key: (trained[0][key], trained[-1][key]) for key in FEATURE_METRICS if key in trained[-1]
    }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--only", nargs="*", default=None, help="recipe names (default: all)")
    parser.add_argument(
        "--mini-batches", type=int, default=1, help="optimizer steps per batch (default 1)"
    )
    parser.add_argument("extra", nargs="*", help="key=value overrides for every run")
    args = parser.parse_args()
    if args.mini_batches > 1:
        batch = 16  # trainer.train_batch_size's default
        args.extra.append(f"trainer.policy_mini_batch_size={batch // args.mini_batches}")
    names = args.only or list(RECIPES)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, name in enumerate(names):
            results[name] = run(RECIPES[name] + args.extra, args.steps, Path(tmp) / f"run{i}")
            r = results[name]
            print(
                f"{name}: reward {r['reward/first_20pct']:.3f} -> {r['reward/last_20pct']:.3f}, "
                f"{r['step_time_mean_s']:.3f} s/step"
                + "".join(f", {k} {a:.4g} -> {b:.4g}" for k, (a, b) in r["features"].items()),
                flush=True,
            )
    base = results.get("GRPO")
    print()
    print(
        "| algorithm | reward, first 20% | reward, last 20% | learns (>= 2x) | step time | "
        "vs GRPO | " + " | ".join(f"`{s}` vs GRPO" for s in STAGES) + " | batches generated "
        "per step |"
    )
    print("|---|---|---|---|---|---|" + "---|" * (len(STAGES) + 1))
    for name, r in results.items():
        first, last = r["reward/first_20pct"], r["reward/last_20pct"]

        def ratio(key: str, r: dict = r) -> str:
            return f"{r[key] / base[key]:.2f}x" if base and base[key] > 0 else "-"

        print(
            f"| {name} | {first:.3f} | {last:.3f} | {'yes' if last >= 2 * first else 'no'} | "
            f"{r['step_time_mean_s']:.3f} s | {ratio('step_time_mean_s')} | "
            + " | ".join(ratio(s) for s in STAGES)
            + f" | {batches_per_step(r):.2f} |"
        )


def batches_per_step(summary: dict) -> float:
    """Batches of prompts generated per step: dynamic sampling's rounds (summary.json's
    totals), else one."""
    rounds = summary.get("totals", {}).get("dynamic_sampling/rounds")
    return rounds / summary["steps"] if rounds else 1.0


if __name__ == "__main__":
    main()
