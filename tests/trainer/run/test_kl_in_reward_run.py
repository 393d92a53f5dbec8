"""A real run with the KL in the reward and the adaptive controller: the step's rewards are
penalised at the coefficient the controller holds, the checkpoint keeps it, and a resumed run
goes on from it (not from ``kl_ctrl.kl_coef``)."""

from __future__ import annotations

import json

import pytest

import trainer.run
from trainer.config import load_config

RUN = [
    "engine.backend=inprocess",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "generator.sampling.max_tokens=2",
    "algorithm.entropy_coeff=0.01",  # the policy moves off the reference whatever the rewards
    "trainer.ckpt_interval=1",
    "trainer.progress=false",
    "algorithm.use_kl_in_reward=true",
    "algorithm.kl_ctrl.type=adaptive",
    "algorithm.kl_ctrl.kl_coef=0.1",
    "algorithm.kl_ctrl.target_kl=0.001",
    "algorithm.kl_ctrl.horizon=10",
]


def _rows(run_dir) -> dict[int, dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in map(json.loads, lines)}


def _next(coef: float, kl: float) -> float:
    """verl's AdaptiveKLController by hand: 4 trajectories a step (2 prompts x 2), target
    0.001, horizon 10."""
    error = min(max(kl / 0.001 - 1, -0.2), 0.2)
    return coef * (1 + error * 4 / 10)


async def test_a_resumed_run_goes_on_with_the_checkpointed_coefficient(tmp_path):
    await trainer.run.train(
        load_config(None, [*RUN, "trainer.max_steps=2", f"trainer.run_dir={tmp_path}"])
    )
    rows = _rows(tmp_path)
    # step 1: the policy is the reference model, KL 0: the coefficient falls by 0.2 * 4 / 10
    assert rows[1]["reward/kl_coef"] == 0.1 and rows[1]["reward/kl_penalty"] == 0.0
    assert rows[2]["reward/kl_coef"] == pytest.approx(0.1 * 0.92, rel=1e-12)
    assert rows[2]["reward/kl_penalty"] != 0  # the policy moved after one update (k1: any sign)
    saved = _next(rows[2]["reward/kl_coef"], rows[2]["reward/kl_penalty"])
    state = json.loads((tmp_path / "checkpoints/global_step_2/trainer_state.json").read_text())
    assert state["kl_ctrl"] == {"type": "adaptive", "coef": pytest.approx(saved, rel=1e-12)}
    resume = [
        *RUN,
        "trainer.max_steps=3",
        f"trainer.run_dir={tmp_path}",
        "trainer.resume_mode=latest",
    ]
    await trainer.run.train(load_config(None, resume))
    step3 = _rows(tmp_path)[3]
    assert step3["reward/kl_coef"] == pytest.approx(saved, rel=1e-12)
    assert step3["reward/kl_coef"] != pytest.approx(0.1)
