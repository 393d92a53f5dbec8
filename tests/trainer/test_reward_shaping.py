"""DAPO's soft overlong punishment against hand-worked values, its config checks, and runs of
the algorithms beyond GRPO through the real step loop (in this process, in-process engine)."""

from __future__ import annotations

import json
import math

import pytest
import torch

import trainer.run
from trainer.algorithms import overlong_penalty
from trainer.config import load_config
from trainer.errors import ConfigError


def test_overlong_penalty_falls_linearly_through_the_buffer():
    # budget 10, buffer 4: free up to 6 tokens, then -1/4 per token, -1 at 10
    lengths = torch.tensor([0, 6, 7, 8, 10])
    got = overlong_penalty(lengths, max_length=10, buffer_len=4, penalty=1.0)
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    # the penalty scales it: 9 tokens, 3 into the buffer, at 0.5 -> -3/4 * 0.5
    assert overlong_penalty(torch.tensor([9]), 10, 4, penalty=0.5).tolist() == [-0.375]
    with pytest.raises(ValueError, match=r"overlong buffer must be in \(0, max_length=10\]"):
        overlong_penalty(lengths, 10, 11)
    with pytest.raises(ValueError, match="penalty must be >= 0"):
        overlong_penalty(lengths, 10, 4, penalty=-1.0)


def test_an_overlong_buffer_past_the_response_budget_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"overlong_buffer.len=5 is out of range: .* budget, 4"):
        load_config(None, ["algorithm.overlong_buffer.len=5"])  # max_tokens 4, one turn
    cfg = load_config(None, ["algorithm.overlong_buffer.len=4"])
    assert cfg.generator.response_budget == 4


RUN = [
    "engine.backend=inprocess",
    "trainer.max_steps=3",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=4",
    "data.reward_fn=tests.trainer.helpers:varied_reward",
    "trainer.progress=false",
]


@pytest.mark.parametrize(
    "overrides",
    [
        # DAPO's pieces: clip-higher (the default), token-mean, overlong shaping; REINFORCE++
        ["algorithm.advantage_estimator=reinforce_plus_plus", "algorithm.overlong_buffer.len=2"],
        # GSPO on group baselines, with two updates per batch so its ratios move off 1
        [
            "algorithm.policy_loss=gspo",
            "algorithm.advantage_estimator=reinforce_plus_plus_baseline",
            "trainer.update_epochs=2",
        ],
        # CISPO on pass@k advantages, Dr. GRPO's aggregation
        [
            "algorithm.policy_loss=cispo",
            "algorithm.advantage_estimator=grpo_passk",
            "algorithm.loss_agg_mode=seq-mean-token-sum-norm",
        ],
    ],
    ids=["reinforce_pp-overlong", "gspo-rpp_baseline", "cispo-passk-norm"],
)
async def test_the_step_loop_trains_with_each_family_and_logs_its_metrics(tmp_path, overrides):
    cfg = load_config(None, [*RUN, f"trainer.run_dir={tmp_path}", *overrides])
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "policy/loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
        assert r["policy/grad_norm"] > 0  # every family really produced a gradient
    last = steps[-1]
    if "algorithm.overlong_buffer.len=2" in overrides:
        # the budget is 4 tokens: a response of 3 is punished -1/2, of 4 -1
        assert -1.0 <= last["overlong_buffer/penalty_mean"] <= 0.0
        assert 0.0 <= last["overlong_buffer/punished_frac"] <= 1.0
    if "algorithm.policy_loss=gspo" in overrides:
        # the second epoch's sequence ratios are no longer exactly 1
        assert last["policy/seq_ratio_max"] >= last["policy/seq_ratio_min"] > 0
        assert any(r["policy/seq_ratio_max"] != 1.0 for r in steps)
    if "algorithm.policy_loss=cispo" in overrides:
        assert 0.0 <= last["policy/clip_frac"] <= 1.0
        assert "policy/dual_clip_frac" not in last
