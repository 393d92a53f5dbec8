"""Which engine takes a request, and what taking one out does to the requests on it."""

from __future__ import annotations

import pytest
import trio

from engines.client import Rotation, is_engine_failure
from trainer.errors import InferenceServerError

URLS = ["http://a:1", "http://b:2", "http://c:3/"]


def test_a_trajectory_stays_on_its_engine_and_moves_only_while_that_one_is_out():
    rotation = Rotation(URLS)
    assert rotation.urls[2] == "http://c:3"  # one spelling
    home = rotation.pick("traj-7")
    assert home is not None and {rotation.pick("traj-7") for _ in range(10)} == {home}
    rotation.take_out(home)
    moved = rotation.pick("traj-7")
    assert moved is not None and moved != home
    assert rotation.members == [u for i, u in enumerate(rotation.urls) if i != home]
    rotation.join(home, "http://new:9")
    assert rotation.pick("traj-7") == moved  # joining: a member, not in rotation
    assert "http://new:9" in rotation.members
    rotation.put_back(home)
    assert rotation.pick("traj-7") == home


def test_without_a_trajectory_requests_go_round_the_live_engines():
    rotation = Rotation(URLS)
    rotation.take_out(1)
    assert [rotation.pick(None) for _ in range(4)] == [0, 2, 0, 2]
    for i in (0, 2):
        rotation.take_out(i)
    assert rotation.pick(None) is None and rotation.members == []


async def test_taking_an_engine_out_cancels_its_requests_and_a_new_one_waits_for_a_live_one():
    rotation = Rotation(URLS[:1])
    cut: list[bool] = []

    async def on_it() -> None:
        with rotation.request(0) as scope:
            await trio.sleep_forever()
        cut.append(scope.cancelled_caught)

    picked: list[int] = []

    async def waiting() -> None:
        picked.append(await rotation.wait_pick(None))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_it)
        await trio.sleep(0.01)
        rotation.take_out(0)
        await trio.sleep(0.01)
        assert cut == [True]
        nursery.start_soon(waiting)
        await trio.sleep(0.01)
        assert picked == []  # none live: it waits
        rotation.join(0, "http://a:2")
        await trio.sleep(0.01)
        assert picked == []
        rotation.put_back(0)
    assert picked == [0]
    with rotation.request(0) as scope:  # live again: a request runs
        await trio.lowlevel.checkpoint()
    assert not scope.cancelled_caught


def test_a_failure_is_reported_once_and_only_the_engines_own_count():
    rotation = Rotation(URLS)
    reports: list[tuple[int, str]] = []
    rotation.on_failure = lambda i, cause: reports.append((i, cause))
    rotation.failed(1, "ConnectError")
    rotation.failed(1, "ConnectError again")  # already out: once
    assert reports == [(1, "ConnectError")] and rotation.states == ["live", "down", "live"]
    assert is_engine_failure(InferenceServerError(URLS[0], "/v1/completions", None, "reset"))
    assert is_engine_failure(InferenceServerError(URLS[0], "/v1/completions", 503, "dying"))
    assert not is_engine_failure(InferenceServerError(URLS[0], "/v1/completions", 400, "bad"))


def test_an_unknown_url_is_an_error():
    with pytest.raises(ValueError):
        Rotation(URLS).index_of("http://elsewhere:1")
