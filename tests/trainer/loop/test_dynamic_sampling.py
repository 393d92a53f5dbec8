"""DAPO's dynamic sampling (``algorithm.dynamic_sampling.type=filter``) through the real step
loop in this process: only informative groups are trained, the batch is filled from more
rounds, the bound ends the search with a warning and a metric, and resume stays exact."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

import trainer.run
from trainer.config import load_config
from trainer.data import load_datasets
from trainer.errors import ConfigError

RUN = [
    "engine.backend=inprocess",
    "trainer.train_batch_size=3",
    "generator.n_samples_per_prompt=4",
    "data.reward_fn=tests.trainer.helpers:half_informative_reward",
    "trainer.progress=false",
    "algorithm.dynamic_sampling.type=filter",
]


def _rows(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "reward/mean" in r]


async def _train(run_dir: Path, *overrides: str) -> list[dict]:
    cfg = load_config(None, [*RUN, f"trainer.run_dir={run_dir}", *overrides])
    await trainer.run.train(cfg)
    return _rows(run_dir)


async def test_a_step_trains_only_informative_groups_and_fills_its_batch(tmp_path):
    rows = await _train(tmp_path, "trainer.max_steps=4")
    examples = load_datasets(load_config(None, RUN).data, 0).train
    answers = {ex.index: int(ex.answer) for ex in examples}
    rounds = 0
    for r in rows:
        # three groups, each of a prompt whose answer is odd (the even ones teach nothing)
        assert len(r["data/example_index"]) == 3, r
        assert all(answers[i] % 2 == 1 for i in r["data/example_index"]), r
        assert r["dynamic_sampling/exhausted"] == 0.0
        assert 0 < r["dynamic_sampling/kept_frac"] <= 1
        rounds += r["dynamic_sampling/rounds"]
    # about half the prompts are even: some step needed a second round
    assert rounds > len(rows)
    assert any(r["dynamic_sampling/kept_frac"] < 1 for r in rows)


async def test_past_max_rounds_the_step_trains_on_what_it_has_and_says_so(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        rows = await _train(
            tmp_path,
            "trainer.max_steps=2",
            "algorithm.dynamic_sampling.max_rounds=1",
            "trainer.train_batch_size=8",
        )
    short = [r for r in rows if r["dynamic_sampling/exhausted"] == 1.0]
    assert short, rows  # 8 prompts in one round: some were even
    for r in short:
        assert r["dynamic_sampling/rounds"] == 1.0
        assert len(r["data/example_index"]) == round(8 * r["dynamic_sampling/kept_frac"])
    assert "dynamic sampling found" in caplog.text and "max_rounds" in caplog.text


@pytest.mark.parametrize("strategy", ["sync", "fully_async"])
async def test_resume_continues_the_data_order_exactly(tmp_path, strategy):
    common = ["trainer.max_steps=4", f"trainer.strategy={strategy}"]
    if strategy == "fully_async":
        common += ["trainer.fully_async.max_staleness_steps=0"]
    whole = await _train(tmp_path / "whole", *common)
    first = await _train(
        tmp_path / "cut", *common, "trainer.max_steps=2", "trainer.ckpt_interval=2"
    )
    resumed = await _train(tmp_path / "cut", *common, "trainer.resume_mode=latest")
    order = [r["data/example_index"] for r in whole]
    assert [r["data/example_index"] for r in first + resumed[-2:]] == order
    if strategy == "sync":  # the same prompts, samples and so rewards
        assert [r["reward/mean"] for r in first + resumed[-2:]] == [r["reward/mean"] for r in whole]
    assert all(r["dynamic_sampling/exhausted"] == 0.0 for r in whole)


def test_a_filter_no_group_can_pass_is_refused_at_load():
    with pytest.raises(ConfigError, match="n_samples_per_prompt=1 no group can: set it to 2"):
        load_config(None, [*RUN, "generator.n_samples_per_prompt=1"])
