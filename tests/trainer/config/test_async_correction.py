"""Fully-async says what it corrects (issue 61, part 4): with staleness above 0, turning every
correction off is refused at load in one line naming the choices; the default (``auto``) runs
token TIS and the run says so once, at its start."""

from __future__ import annotations

import json
import logging

import pytest

import trainer.run
from trainer.config import load_config
from trainer.errors import ConfigError

ASYNC = ["trainer.strategy=fully_async"]


@pytest.mark.parametrize("staleness", [1, 4])
def test_no_correction_at_staleness_above_zero_is_refused_naming_the_choices(staleness):
    overrides = [
        *ASYNC,
        f"trainer.fully_async.max_staleness_steps={staleness}",
        "algorithm.off_policy_correction=none",
    ]
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    message = str(info.value)
    assert "\n" not in message
    assert f"max_staleness_steps={staleness}" in message
    for choice in (
        "algorithm.off_policy_correction=tis",
        "algorithm.rollout_correction.rollout_is=token|sequence",
        "algorithm.rollout_correction.rollout_rs=token|sequence|geometric|icepop",
        "algorithm.rollout_correction.bypass_mode=true",
    ):
        assert choice in message


def test_allow_uncorrected_runs_stale_samples_uncorrected_and_says_so():
    overrides = [
        *ASYNC,
        "trainer.fully_async.max_staleness_steps=2",
        "algorithm.off_policy_correction=none",
        "algorithm.rollout_correction.allow_uncorrected=true",
    ]
    plan = load_config(None, overrides).plan
    assert (plan.correction.rollout_is, plan.correction.rollout_rs) == (None, None)
    assert not plan.correction.bypass_mode
    note = plan.correction_note
    assert note is not None and "\n" not in note
    assert "UNCORRECTED" in note and "max_staleness_steps=2" in note
    # the refusal names the opt-out; the opt-out alone does not turn auto's TIS off
    with pytest.raises(ConfigError, match="allow_uncorrected=true runs it uncorrected"):
        load_config(None, overrides[:-1])
    auto = load_config(None, [*ASYNC, "algorithm.rollout_correction.allow_uncorrected=true"])
    assert auto.plan.correction.rollout_is == "token"


@pytest.mark.parametrize(
    "chosen",
    [
        ["trainer.fully_async.max_staleness_steps=0"],  # on-policy: nothing to correct
        ["algorithm.rollout_correction.rollout_rs=geometric"],
        ["algorithm.rollout_correction.rollout_is=sequence"],
        ["algorithm.rollout_correction.bypass_mode=true"],
        ["trainer.strategy=sync"],
    ],
)
def test_none_is_accepted_where_something_else_corrects_or_nothing_is_stale(chosen):
    cfg = load_config(None, [*ASYNC, "algorithm.off_policy_correction=none", *chosen])
    assert cfg.plan.correction_note is None


def test_the_default_corrects_with_token_tis_and_says_so():
    plan = load_config(None, ASYNC).plan
    assert (plan.correction.rollout_is, plan.correction.rollout_is_threshold) == ("token", 2.0)
    note = plan.correction_note
    assert note is not None and "\n" not in note
    assert "max_staleness_steps=4" in note and "token TIS capped at tis_cap=2" in note
    assert "algorithm.rollout_correction.rollout_rs=" in note  # how to choose another
    untruncated = load_config(None, [*ASYNC, "algorithm.tis_cap=null"]).plan.correction_note
    assert untruncated is not None and "token TIS untruncated" in untruncated
    # chosen by the user, or nothing stale: nothing to say
    for overrides in (
        [*ASYNC, "algorithm.off_policy_correction=tis"],
        [*ASYNC, "algorithm.rollout_correction.rollout_is=token"],
        [*ASYNC, "trainer.fully_async.max_staleness_steps=0"],
        [],
    ):
        assert load_config(None, overrides).plan.correction_note is None, overrides


async def test_a_fully_async_run_logs_its_correction_once_at_the_start(tmp_path, caplog):
    cfg = load_config(
        None,
        [
            *ASYNC,
            "engine.backend=inprocess",
            "trainer.progress=false",
            "trainer.max_steps=2",
            "trainer.fully_async.max_staleness_steps=1",
            f"trainer.run_dir={tmp_path}",
        ],
    )
    with caplog.at_level(logging.WARNING):
        await trainer.run.train(cfg)
    lines = [r.getMessage() for r in caplog.records if "correcting the stale" in r.getMessage()]
    assert lines == [cfg.plan.correction_note]
    assert "max_staleness_steps=1" in lines[0]
    log = (tmp_path / "train.log").read_text()
    assert log.count("correcting the stale samples") == 1
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any("policy/is_truncated_frac" in r for r in rows)  # token TIS did run
