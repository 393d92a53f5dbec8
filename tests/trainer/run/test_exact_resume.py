"""A run of N steps and a run of N/2 steps plus a resume give the same numbers, step for step.

Model, optimizer, learning-rate schedule, RNG state and data position all come back from the
checkpoint; if any of them did not, the resumed steps' losses, KL, gradient norms or learning
rates would differ from the uninterrupted run's. Every step strategy of the schema
(``trainer.strategy``) is covered: a new one joins this test by being added to the schema.
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

import trainer.run
from trainer.config import load_config
from trainer.config._schema import TrainerConfig

STRATEGIES = typing.get_args(typing.get_type_hints(TrainerConfig)["strategy"])

STEPS = 4
SMALL = [
    "engine.backend=inprocess",
    "trainer.train_batch_size=4",
    "generator.n_samples_per_prompt=2",
    "trainer.policy_mini_batch_size=2",  # two optimizer steps per step
    "trainer.ckpt_interval=2",
    "trainer.progress=false",
    "optim.warmup_steps=3",  # the learning rate changes across the resume
    "algorithm.use_kl_loss=true",  # a reference model and a KL term
    "data.reward_fn=tests.trainer.helpers:varied_reward",
]

#: Per strategy: fully-async with no staleness allowed trains each step on exactly the groups
#: admitted after the previous sync (in data order), so its numbers are reproducible too;
#: with staleness > 0 which groups make a batch depends on timing (test_fully_async.py
#: checks that a resume trains every prompt exactly once instead).
#: Its off-policy correction (on by default there) is off: the weights come from the engine's
#: logprobs, which move in the last float bits with how the engine's batches formed (the
#: update would too).
STRATEGY_KEYS = {
    "sync": [],
    "fully_async": [
        "trainer.fully_async.max_staleness_steps=0",
        "algorithm.off_policy_correction=none",
    ],
}

#: Wall-clock measurements and paths: the only keys allowed to differ between the runs.
MEASURED_PREFIXES = ("timing/", "loop/", "memory/")
MEASURED_KEYS = {
    "checkpoint/path",
    "checkpoint/max_stall_ms",
    "sync/last_weight_sync_seconds",
    "sync/max_stall_ms",
    "async/generator_idle_ratio",
    "async/trainer_idle_ratio",
}


def _computed(run_dir: Path) -> list[dict]:
    """Each step's metrics without the measured ones."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [
        {
            k: v
            for k, v in row.items()
            if not k.startswith(MEASURED_PREFIXES) and k not in MEASURED_KEYS
        }
        for row in rows
    ]


@pytest.mark.parametrize("strategy", STRATEGIES)
async def test_half_a_run_plus_a_resume_computes_what_the_whole_run_computes(tmp_path, strategy):
    common = [*SMALL, f"trainer.strategy={strategy}", *STRATEGY_KEYS[strategy]]
    whole, halves = tmp_path / "whole", tmp_path / "halves"
    await trainer.run.train(
        load_config(None, [*common, f"trainer.run_dir={whole}", f"trainer.max_steps={STEPS}"])
    )
    await trainer.run.train(
        load_config(None, [*common, f"trainer.run_dir={halves}", f"trainer.max_steps={STEPS // 2}"])
    )
    await trainer.run.train(
        load_config(
            None,
            [
                *common,
                f"trainer.run_dir={halves}",
                f"trainer.max_steps={STEPS}",
                "trainer.resume_mode=latest",
            ],
        )
    )
    assert f"at step {STEPS // 2}" in (halves / "train.log").read_text()  # it did resume

    expected, got = _computed(whole), _computed(halves)
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    # not a comparison of zeros: every step learns something, and each step differently
    assert {"reward/mean", "policy/loss", "policy/kl", "policy/grad_norm", "policy/lr"} <= (
        expected[-1].keys()
    )
    assert all(r["policy/grad_norm"] > 0 for r in expected)
    assert len({r["policy/loss"] for r in expected}) == STEPS
    assert len({r["policy/lr"] for r in expected}) > 1
    for step, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        # the engine's logprobs of the same tokens move in the last float bits with how its
        # batches formed (request timing): the diagnostic ratio built from them is compared
        # closely, everything the update computes exactly
        for k in [k for k in want if k.startswith("policy/is_ratio")]:
            assert have.pop(k) == pytest.approx(want.pop(k), rel=1e-5), (step, k)
        assert have == want, f"step {step} differs after the resume"
