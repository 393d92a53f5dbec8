"""engines.launch, placed by Ray: servers in real Ray actors start, serve, fail loudly, and never linger.

Every test tags the actors it starts (and so their servers) with a fresh
``TRAINER_TEST_MARKER`` and checks afterwards that no process carrying it is left.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

import pytest
import ray
import trio

from engines.client import InferenceClient
from engines.launch import EngineServerActor, ReferenceServers, ServerSpec, open_ray_engines
from engines.types import SamplingParams
from tests.e2e.helpers import (
    new_marker,
    pid_alive,
    processes_with_marker,
    run_in_own_ray_cluster,
    wait_until_gone,
)
from trainer.errors import EngineStartError
from trainer.workers.ray_cluster import actor_env

pytestmark = pytest.mark.slow

STARTUP_S = 180.0


@pytest.fixture
def marker(monkeypatch: pytest.MonkeyPatch) -> str:
    value = new_marker()
    monkeypatch.setenv("TRAINER_TEST_MARKER", value)  # in actor_env(): actors get it, servers too
    return value


def leftovers(marker: str, timeout: float = 30.0) -> list[int]:
    return wait_until_gone(marker, timeout, ignore=lambda pid: pid == os.getpid())


def actor_is_dead(actor: object) -> bool:
    try:
        ray.get(actor.log_tail.remote(), timeout=30)  # type: ignore[attr-defined]
    except ray.exceptions.RayActorError:
        return True
    return False


async def test_servers_in_actors_serve_over_http_and_are_gone_after(
    ray_cluster: str, model_dir: Path, tmp_path: Path, marker: str
) -> None:
    async with open_ray_engines(
        2,
        ReferenceServers(str(model_dir), seed=7),
        tmp_path / "engines",
        startup_timeout_s=STARTUP_S,
        env=actor_env(),
    ) as engines:
        assert [e.index for e in engines] == [0, 1]
        assert len({e.url for e in engines}) == 2
        assert all(e.url.startswith(f"http://{e.node_ip}:") for e in engines)
        assert set(processes_with_marker(marker)) >= {e.pid for e in engines}
        async with InferenceClient([e.url for e in engines], api_key=engines[0].api_key) as client:
            completion = await client.generate([5, 6], SamplingParams(max_tokens=4, seed=0))
        assert len(completion.token_ids) >= 1
        # logs land where asked, one per server, with the server's ready line
        for e in engines:
            assert e.log_path == str(tmp_path / "engines" / f"engine-{e.index}.log")
            assert "ENGINE_READY" in await trio.Path(e.log_path).read_text()
        actors = [e.actor for e in engines]
        servers = [e.pid for e in engines]
    # stopped through their actors before the block ends (not left to the stdin-EOF fallback
    # of a killed actor, which would take the server a while longer)
    assert not any(pid_alive(p) for p in servers)
    assert leftovers(marker) == []
    assert all(await trio.to_thread.run_sync(lambda: [actor_is_dead(a) for a in actors]))


async def test_a_server_that_exits_during_start_up_raises_with_its_log_tail(
    ray_cluster: str, tmp_path: Path, marker: str
) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(EngineStartError) as caught:
        async with open_ray_engines(
            1,
            ReferenceServers(str(missing)),
            tmp_path / "engines",
            startup_timeout_s=STARTUP_S,
            env=actor_env(),
        ):
            pytest.fail("start-up should have failed")
    error = caught.value
    assert "exited during start-up" in error.reason
    assert "engine-0" in error.url
    assert str(missing) in error.log_tail  # the server's own complaint, read on its node
    assert pickle.loads(pickle.dumps(error)).log_tail == error.log_tail
    assert leftovers(marker) == []


async def test_a_killed_actor_takes_its_server_down_and_exit_stays_clean(
    ray_cluster: str, model_dir: Path, tmp_path: Path, marker: str
) -> None:
    async with open_ray_engines(
        1,
        ReferenceServers(str(model_dir)),
        tmp_path / "engines",
        startup_timeout_s=STARTUP_S,
        env=actor_env(),
    ) as engines:
        (engine,) = engines
        await trio.to_thread.run_sync(lambda: ray.kill(engine.actor, no_restart=True))
        # no one asked the server to stop: it exits because its stdin pipe closed
        assert await trio.to_thread.run_sync(leftovers, marker, 60.0) == []
    assert leftovers(marker) == []


#: A server whose start-up never ends: it never prints its ready line (until stopped).
NEVER_READY = ("-c", "import time; time.sleep(3600)")


def never_ready_servers(index: int, host: str) -> ServerSpec:
    """:class:`~engines.launch.ServersSpec` of servers that never finish starting, however fast
    the machine (module level: Ray pickles it by reference)."""
    return ServerSpec((sys.executable, *NEVER_READY))


def _never_ready_pids(marker: str) -> list[int]:
    return [
        pid for pid in processes_with_marker(marker) if NEVER_READY[1].encode() in _cmdline(pid)
    ]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


async def test_cancelled_start_up_leaves_nothing(
    ray_cluster: str, tmp_path: Path, marker: str
) -> None:
    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:

            async def cancel_once_both_servers_start() -> None:
                with trio.fail_after(STARTUP_S):  # both servers are running (and never ready)
                    while len(_never_ready_pids(marker)) < 2:  # noqa: ASYNC110
                        await trio.sleep(0.1)
                scope.cancel()

            nursery.start_soon(cancel_once_both_servers_start)
            async with open_ray_engines(
                2,
                never_ready_servers,
                tmp_path / "engines",
                startup_timeout_s=STARTUP_S,
                env=actor_env(),
            ):
                pytest.fail("servers that never finish starting cannot be healthy")
    assert scope.cancelled_caught
    assert leftovers(marker) == []


async def test_a_cluster_without_room_fails_start_up_saying_so(
    ray_cluster: str, model_dir: Path, tmp_path: Path, marker: str
) -> None:
    """An actor no node has room for (here CPUs; GPUs, for a vLLM engine's
    engine.tensor_parallel_size, take the same path) is never placed: start-up fails at its
    bound, naming both (the bound is short: the actor can never be placed, however long)."""
    with pytest.raises(
        EngineStartError, match=r"not placed or not started within 1s: .* GPUs on one node"
    ):
        async with open_ray_engines(
            1,
            ReferenceServers(str(model_dir)),
            tmp_path / "engines",
            startup_timeout_s=1.0,
            num_cpus=1000,
            env=actor_env(),
        ):
            pytest.fail("no node has 1000 CPUs")
    assert leftovers(marker) == []


def test_a_stop_that_wins_the_race_with_start_means_no_server_is_launched(
    ray_cluster: str, tmp_path: Path, marker: str
) -> None:
    """The actor is threaded: teardown's ``stop`` can run before ``start`` launches."""
    actor = EngineServerActor(0, str(tmp_path), ReferenceServers(), None)
    assert actor.stop(1.0) is None  # nothing started yet
    with pytest.raises(EngineStartError, match="stopped during start-up"):
        actor.start()
    assert leftovers(marker, timeout=0) == []


#: In a cluster of its own that declares 3 (logical) GPUs: one engine whose actor reserves 2.
#: Prints the server's CUDA_VISIBLE_DEVICES.
_GPU_PLACEMENT = """
import json, sys, trio, ray
from engines.launch import ReferenceServers, open_ray_engines
from trainer.workers.ray_cluster import actor_env, init_kwargs, prepare_env

prepare_env()
ray.init(**init_kwargs(None, num_cpus=4), num_gpus=3)
model_dir, log_dir = sys.argv[1], sys.argv[2]

async def main():
    out = {}
    async with open_ray_engines(
        1, ReferenceServers(model_dir), log_dir, num_gpus=2, startup_timeout_s=120, env=actor_env()
    ) as (engine,):
        environ = open(f"/proc/{engine.pid}/environ", "rb").read().split(b"\\0")
        out["visible"] = [v.decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")]
    print("RESULT " + json.dumps(out))

trio.run(main)
ray.shutdown()
"""


def test_an_engine_actor_reserves_its_gpus_and_its_server_sees_exactly_them(
    model_dir: Path, tmp_path: Path, marker: str
) -> None:
    """A vLLM engine placed by Ray (engine.tensor_parallel_size GPUs): Ray gives its actor
    that many GPUs and their CUDA_VISIBLE_DEVICES, which the server inherits (its spec sets
    none). Logical GPUs: Ray assigns them on a CPU machine as on a GPU one. (A cluster without
    that many: an actor never placed, as in the test of a cluster without room above.)"""
    result = run_in_own_ray_cluster(
        _GPU_PLACEMENT, str(model_dir), str(tmp_path / "engines"), timeout_s=240
    )
    (visible,) = result["visible"]
    assert len(visible.removeprefix("CUDA_VISIBLE_DEVICES=").split(",")) == 2, visible
    assert leftovers(marker) == []
