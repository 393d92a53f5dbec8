"""PPO with a critic end to end, on each workers backend: the critic trains from the first step,
the policy waits through ``critic.warmup_steps``, both are checkpointed, and a run resumed from
a checkpoint computes what the uninterrupted run computed (critic and policy alike). A hang in
a critic call ends the step typed, naming the critic's operation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import trainer.run
from tests.trainer.run.test_exact_resume import MEASURED_KEYS, MEASURED_PREFIXES
from trainer.config import load_config
from trainer.errors import StepTimeoutError
from trainer.workers.critic import CRITIC_FILES

STEPS = 3
SMALL = [
    "engine.backend=inprocess",
    "algorithm.advantage_estimator=gae",
    "algorithm.lam=0.95",
    "critic.warmup_steps=1",  # step 1 trains the critic only
    "critic.optim.warmup_steps=2",  # the critic's learning rate changes across the resume
    "critic.optim.lr=3e-3",
    "trainer.train_batch_size=4",
    "generator.n_samples_per_prompt=2",
    "trainer.policy_mini_batch_size=2",  # two optimizer steps per step, for each model
    "trainer.ckpt_interval=1",
    "trainer.progress=false",
    "data.reward_fn=tests.trainer.helpers:varied_reward",
]


def rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [
        {
            k: v
            for k, v in json.loads(line).items()
            if not k.startswith(MEASURED_PREFIXES) and k not in MEASURED_KEYS
        }
        for line in lines
    ]


#: Each workers backend, and fully-async training (its numbers are reproducible with no
#: staleness allowed and the off-policy correction off: test_exact_resume.py says why).
RUNS = {
    "local": [],
    "ray": ["workers.backend=ray", "workers.num_policy_workers=2"],
    "local-fully_async": [
        "trainer.strategy=fully_async",
        "trainer.fully_async.max_staleness_steps=0",
        "algorithm.off_policy_correction=none",
    ],
}


@pytest.mark.parametrize("run", list(RUNS))
async def test_critic_trains_checkpoints_and_resumes_exactly(tmp_path, run, request):
    common = [*SMALL, *RUNS[run]]
    if run == "ray":
        common.append(f"workers.ray_address={request.getfixturevalue('ray_cluster')}")
        common.append("workers.device=cpu")  # a cluster the run joins: said, not guessed
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    await trainer.run.train(
        load_config(None, [*common, f"trainer.run_dir={whole}", f"trainer.max_steps={STEPS}"])
    )
    checkpoint = whole / "checkpoints" / "global_step_2"
    for name in CRITIC_FILES:
        assert (checkpoint / name).exists(), name
    await trainer.run.train(
        load_config(
            None,
            [
                *common,
                f"trainer.run_dir={resumed}",
                f"trainer.max_steps={STEPS}",
                "trainer.resume_mode=path",
                f"trainer.resume_path={checkpoint}",
            ],
        )
    )
    expected, got = rows(whole), rows(resumed)
    assert [r["step"] for r in expected] == [1, 2, 3]
    first = expected[0]
    # step 1: the critic trained, the policy waited
    assert first["critic/grad_norm"] > 0 and "policy/grad_norm" not in first
    assert {"critic/vf_loss", "critic/vf_clip_frac", "critic/values_mean"} <= first.keys()
    assert "critic/vf_explained_var" in first
    for r in expected[1:]:
        assert r["policy/grad_norm"] > 0 and r["critic/grad_norm"] > 0
    assert len({r["critic/lr"] for r in expected}) > 1  # the warm-up moves it
    # the critic learns something: each step's values differ
    assert len({r["critic/values_mean"] for r in expected}) == STEPS
    assert got[-1]["step"] == STEPS
    assert got[-1] == expected[-1], "step 3 differs after resuming from step 2's checkpoint"


async def test_a_hung_critic_call_ends_the_step_naming_it(tmp_path):
    cfg = load_config(
        None,
        [
            *SMALL,
            "trainer.max_steps=2",
            "trainer.ckpt_interval=0",
            "trainer.step_timeout_s=5",
            "faults=critic_forward_backward:hang@2",
            f"trainer.run_dir={tmp_path}",
        ],
    )
    with pytest.raises(StepTimeoutError) as info:
        await trainer.run.train(cfg)
    err = info.value
    assert (err.step, err.stage, err.operation) == (
        2,
        "train_critic_and_policy",
        "critic_forward_backward",
    )
