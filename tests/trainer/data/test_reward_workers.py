"""Rewards in worker processes and async rewards: each call bounded, failures counted, the
run's limit typed, and no process left behind (real processes, real hangs)."""

from __future__ import annotations

import os
import time

import psutil
import pytest
import trio

from trainer.config import load_config
from trainer.data import count_reward_failures, open_rewards
from trainer.data._examples import resolve_reward_fn
from trainer.errors import RewardError

MISBEHAVING = "tests.trainer.data.rewards:misbehaving"
TIMEOUT_S = 1.0
#: Generous: a loaded two-core machine can take seconds to kill and reap a process.
MARGIN_S = 15.0


def _data(*overrides: str):
    return load_config(None, list(overrides)).data


def _workers(rewards) -> set[int]:
    return {w.process.pid for w in rewards.runner.pool._workers}  # noqa: SLF001 (the pids)


def _gone(pids: set[int]) -> bool:
    return not any(psutil.pid_exists(p) for p in pids)


async def test_a_hanging_a_spinning_and_a_self_killing_reward_each_cost_their_bound_and_count():
    data = _data(
        f"data.reward_fn={MISBEHAVING}",
        "data.reward_workers=2",
        f"data.reward_timeout_s={TIMEOUT_S}",
        "data.max_reward_failures=4",
        "data.reward_on_failure=-1",
    )
    seen: set[int] = set()
    async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
        with count_reward_failures() as tally:
            for response, failed in [
                ("sleep", "timeouts"),
                ("burn", "timeouts"),
                ("kill", "errors"),
            ]:
                seen |= _workers(reward)
                before = tally.metrics()[f"reward/{failed}"]
                start = time.monotonic()
                assert await reward.score(response, "7") == -1.0
                assert time.monotonic() - start < TIMEOUT_S + MARGIN_S, response
                assert tally.metrics()[f"reward/{failed}"] == before + 1
            # the run goes on: replaced workers answer the next calls
            assert await reward.score("7", "7") == 1.0
            assert await reward.score("raise", "7") == -1.0
            seen |= _workers(reward)
        assert tally.metrics() == {"reward/timeouts": 2.0, "reward/errors": 2.0}
        assert len(seen) >= 4  # two started, at least two replacements
    assert _gone(seen)
    assert not [c for c in psutil.Process(os.getpid()).children(recursive=True) if c.pid in seen]


async def test_one_failure_past_the_limit_ends_the_batch_with_reward_error_and_kills_the_workers():
    data = _data(
        f"data.reward_fn={MISBEHAVING}",
        "data.reward_workers=1",
        f"data.reward_timeout_s={TIMEOUT_S}",
        "data.max_reward_failures=1",
    )
    seen: set[int] = set()
    with pytest.raises(RewardError) as info:
        async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
            seen |= _workers(reward)
            with count_reward_failures():
                assert await reward.score("raise", "7") == 0.0
                await reward.score("kill", "7")
    err = info.value
    assert (err.reward_fn, err.failures, err.limit, err.response) == (MISBEHAVING, 2, 1, "kill")
    assert "died" in err.reason
    assert _gone(seen)


async def test_a_worker_that_cannot_load_the_reward_is_a_config_error():
    from trainer.errors import ConfigError

    data = _data("data.reward_workers=1")

    def local(response: str, answer: str) -> float:
        return 0.0

    with pytest.raises(ConfigError, match="cannot be imported"):
        async with open_rewards(data, resolve_reward_fn(None, local)):
            pass


async def test_an_async_reward_is_bounded_on_the_loop(autojump_clock):
    data = _data(
        "data.reward_fn=tests.trainer.data.rewards:judge",
        "data.reward_workers=2",  # an async reward stays on the loop
        "data.reward_timeout_s=30",
        "data.max_reward_failures=2",
    )
    async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
        assert reward.runner.pool is None
        with count_reward_failures() as tally:
            start = trio.current_time()
            assert await reward.score("hang", "7") == 0.0
            assert trio.current_time() - start == pytest.approx(30)
            assert await reward.score("raise", "7") == 0.0
            assert await reward.score("7", "7") == 1.0
            assert tally.metrics() == {"reward/timeouts": 1.0, "reward/errors": 1.0}
            with pytest.raises(RewardError, match="ConnectionError"):
                await reward.score("raise", "7")


async def test_without_workers_a_plain_reward_runs_here_and_its_exception_ends_the_run():
    data = _data(f"data.reward_fn={MISBEHAVING}", "data.max_reward_failures=5")
    async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
        assert reward.runner.pool is None
        assert await reward.score("7", "7") == 1.0
        with pytest.raises(ZeroDivisionError):
            await reward.score("raise", "7")
