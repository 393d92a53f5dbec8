"""Rewards in worker processes and async rewards: each call bounded, failures counted, the
run's limit typed, and no process left behind (real processes, real hangs)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import trio

from tests.e2e.helpers import MARKER_ENV, REPO, new_marker, processes_with_marker, wait_until_gone
from trainer.config import load_config
from trainer.data import count_reward_failures, open_rewards
from trainer.data._examples import resolve_reward_fn
from trainer.errors import RewardError

MISBEHAVING = "tests.trainer.data.rewards:misbehaving"
HOSTILE = "tests.trainer.data.rewards:hostile"
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


def _session(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[3])


def _strays(marker: str, workers: set[int]) -> list[int]:
    return [p for p in processes_with_marker(marker) if _session(p) not in workers]


async def _only_live_workers_left(rewards, marker: str) -> list[int]:
    """Processes with ``marker`` outside every live worker's session, once the pool has had
    a bounded moment to kill them (empty: nothing of a killed worker is left)."""
    deadline = time.monotonic() + MARGIN_S
    while True:
        stray = await trio.to_thread.run_sync(_strays, marker, _workers(rewards))
        if not stray or time.monotonic() > deadline:
            return stray
        await trio.sleep(0.2)


async def test_a_reward_that_allocates_forks_exits_or_closes_its_pipe_is_bounded_counted_and_cleaned(
    monkeypatch: pytest.MonkeyPatch,
):
    marker = new_marker()
    monkeypatch.setenv(MARKER_ENV, marker)  # every worker and what it starts carries it
    data = _data(
        f"data.reward_fn={HOSTILE}",
        "data.reward_workers=1",
        f"data.reward_timeout_s={TIMEOUT_S}",
        "data.max_reward_failures=10",
        "data.reward_on_failure=-1",
        "data.reward_max_memory_mb=512",
    )
    async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
        (worker,) = _workers(reward)
        limits = await trio.Path(f"/proc/{worker}/limits").read_text()
        assert f"{512 << 20}" in next(ln for ln in limits.splitlines() if "data size" in ln)
        with count_reward_failures() as tally:
            for response, failed in [
                ("alloc", "errors"),  # MemoryError in the reward: the worker lives on
                ("fork", "timeouts"),  # killed with its three sleepers
                ("exit", "errors"),
                ("close", "errors"),
            ]:
                before = tally.metrics()[f"reward/{failed}"]
                start = time.monotonic()
                assert await reward.score(response, "7") == -1.0, response
                assert time.monotonic() - start < TIMEOUT_S + MARGIN_S, response
                assert tally.metrics()[f"reward/{failed}"] == before + 1, response
                assert await _only_live_workers_left(reward, marker) == [], response
            assert await reward.score("7", "7") == 1.0  # the pool goes on serving
        assert tally.metrics() == {"reward/timeouts": 1.0, "reward/errors": 3.0}
    assert await trio.to_thread.run_sync(wait_until_gone, marker, MARGIN_S) == []


#: Runs a pool whose one worker's reward forks sleepers and hangs; prints "calling" first.
OWNER = """
import sys, trio
from trainer.config import load_config
from trainer.data import open_rewards
from trainer.data._examples import resolve_reward_fn

async def main():
    data = load_config(None, ["data.reward_fn=tests.trainer.data.rewards:hostile",
                              "data.reward_workers=1"]).data
    async with open_rewards(data, resolve_reward_fn(data.reward_fn, float)) as reward:
        print("calling", flush=True)
        await reward.score("fork", "7")

trio.run(main)
"""


def test_when_the_pools_owner_is_killed_its_workers_and_what_they_started_die():
    marker = new_marker()
    env = {**os.environ, MARKER_ENV: marker, "PYTHONPATH": str(REPO)}
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline() == "calling\n"
        # the worker, its reaper and the reward's three sleepers
        deadline = time.monotonic() + 60
        while len(set(processes_with_marker(marker)) - {owner.pid}) < 5:
            assert time.monotonic() < deadline, processes_with_marker(marker)
            time.sleep(0.1)
        owner.kill()
        owner.wait(30)
        assert wait_until_gone(marker, 10.0) == []
    finally:
        owner.kill()
        owner.wait()
        if owner.stdout is not None:
            owner.stdout.close()
