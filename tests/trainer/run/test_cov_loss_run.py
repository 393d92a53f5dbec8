"""A real run with ``algorithm.policy_loss=clip_cov`` completes, and its keys reach the loss."""

from __future__ import annotations

import json

import trainer.run
from trainer.config import load_config


async def test_a_clip_cov_run_completes_detaching_the_share_its_ratio_asks(tmp_path):
    # a window every token's covariance falls in: ratio decides how many are detached (the
    # default, 0.0002, detaches one token of the ~500 a step trains: a share near 0.002)
    over = [
        "engine.backend=inprocess",
        "trainer.progress=false",
        "trainer.max_steps=2",
        "algorithm.policy_loss=clip_cov",
        "algorithm.clip_cov.ratio=0.5",
        "algorithm.clip_cov.lb=-100",
        "algorithm.clip_cov.ub=100",
        f"trainer.run_dir={tmp_path}",
    ]
    await trainer.run.train(load_config(None, over))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [r for r in map(json.loads, lines) if "policy/cov_clip_frac" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["policy/cov_candidates_frac"] == 1.0
        assert 0.45 < r["policy/cov_clip_frac"] <= 0.5
