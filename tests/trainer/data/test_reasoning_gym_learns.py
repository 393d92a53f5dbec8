"""The default tiny model learns a reasoning-gym task in a CI-sized run, its reward computed by
reasoning-gym's scorer in the run's reward worker processes."""

from __future__ import annotations

import json
import os
import statistics

import psutil
import pytest

import trainer.run
from trainer.config import load_config

pytest.importorskip("reasoning_gym")

#: count_bits over 1..31 ("How many 1 bits are there in the binary representation of the
#: number 13?" -> 3): single-digit answers the tiny model's vocabulary can write, no answer
#: tags (it has no such words) and no system prompt (its role reads as <unk>). Measured on
#: 2026-12-04 (load 0.4 on 2 cores): mean reward 0.021 over the first 30 steps, 0.23 over
#: steps 180-200, in 21 s.
RUN = [
    "engine.backend=inprocess",
    "trainer.progress=false",
    "data.task=reasoning_gym",
    "data.reasoning_gym.name=count_bits",
    "data.reasoning_gym.config.max_n=31",
    "data.reasoning_gym.system_prompt=null",
    "data.reasoning_gym.answer_tag=null",
    "data.num_examples=16",
    "trainer.train_batch_size=8",
    "generator.sampling.max_tokens=4",
    "generator.max_response_tokens=4",
    "trainer.max_steps=200",
    "data.reward_workers=2",
    "data.reward_timeout_s=60",
]


async def test_the_tiny_model_learns_count_bits_scored_in_reward_workers(tmp_path):
    await trainer.run.train(load_config(None, [*RUN, f"trainer.run_dir={tmp_path}"]))
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows if "reward/mean" in r]
    assert len(rewards) == 200
    first, last = statistics.fmean(rewards[:40]), statistics.fmean(rewards[-40:])
    assert last > 2 * first + 0.05, (first, last)
    assert all(r["reward/timeouts"] == r["reward/errors"] == 0 for r in rows if "reward/mean" in r)
    # the run's reward workers ended with it
    workers = [
        c
        for c in psutil.Process(os.getpid()).children(recursive=True)
        if "trainer.data._reward_worker" in " ".join(c.cmdline())
    ]
    assert workers == []
