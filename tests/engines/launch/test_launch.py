"""engines.launch: real server processes start, fail loudly, and never outlive their owner."""

from __future__ import annotations

import os
import pickle
import signal
from pathlib import Path

import pytest
import torch
import trio

from engines.client import InferenceClient, RetryPolicy
from engines.launch import (
    ReferenceServers,
    launch_local_engines,
    open_engine_processes,
    server_device,
)
from engines.types import SamplingParams
from tests.e2e.helpers import pid_alive
from tests.engines.helpers import stats
from trainer.errors import EngineStartError, InferenceServerError

STARTUP_S = 180.0


async def test_a_server_killed_mid_request_gives_an_error_naming_it(
    model_dir: Path, tmp_path: Path
) -> None:
    async with open_engine_processes(
        2, ReferenceServers(str(model_dir)), tmp_path, startup_timeout_s=STARTUP_S
    ) as engines:
        pids = [e.pid for e in engines]
        victim = engines[0]
        caught: list[InferenceServerError] = []
        async with InferenceClient(
            [victim.url], api_key=engines.api_key, retry=RetryPolicy(max_retries=2, backoff_s=0.05)
        ) as client:

            async def generate() -> None:
                with pytest.raises(InferenceServerError) as info:
                    await client.generate([1, 2], SamplingParams(max_tokens=200, ignore_eos=True))
                caught.append(info.value)

            # paused first: the request waits in the server, so however fast the engine it
            # is still unanswered when the server dies
            await client.pause("keep")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(generate)
                with trio.fail_after(60):
                    while (await stats(victim.url, engines.api_key))["num_requests_waiting"] < 1:  # noqa: ASYNC110
                        await trio.sleep(0.02)
                os.killpg(victim.pid, signal.SIGKILL)
        assert caught[0].url == victim.url
        assert victim.url in str(caught[0])
        assert caught[0].status is None

        # The launcher going away closes the server's stdin: it shuts down by itself.
        survivor = engines[1]
        assert survivor.process.stdin is not None
        await survivor.process.stdin.aclose()
        with trio.fail_after(60):
            await survivor.process.wait()
        assert survivor.process.returncode == 0
    assert not any(pid_alive(pid) for pid in pids)
    assert (tmp_path / "engine-0.log").exists() and (tmp_path / "engine-1.log").exists()


async def test_cancellation_stops_every_server(model_dir: Path, tmp_path: Path) -> None:
    pids: list[int] = []
    with trio.CancelScope() as scope:
        async with open_engine_processes(
            1, ReferenceServers(str(model_dir)), tmp_path, startup_timeout_s=STARTUP_S
        ) as engines:
            pids = [e.pid for e in engines]
            assert all(pid_alive(pid) for pid in pids)
            scope.cancel()
            await trio.sleep_forever()
    assert pids
    assert not any(pid_alive(pid) for pid in pids)


async def test_a_server_that_dies_at_start_raises_engine_start_error_with_its_log(
    tmp_path: Path,
) -> None:
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    with pytest.raises(EngineStartError) as info:
        async with launch_local_engines(
            1, not_a_model, tmp_path / "logs", startup_timeout_s=STARTUP_S
        ):
            pytest.fail("started a server on a directory without a model")
    err = info.value
    assert "exited during start-up" in err.reason
    assert "config.json" in err.log_tail
    assert "config.json" in str(err)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.url, clone.reason, clone.log_tail) == (err.url, err.reason, err.log_tail)


async def test_a_server_not_healthy_in_time_raises_and_is_stopped(
    model_dir: Path, tmp_path: Path
) -> None:
    before = set(_children_running_engines_local())
    with pytest.raises(EngineStartError, match=r"not healthy within 0\.2s"):
        async with open_engine_processes(
            1, ReferenceServers(str(model_dir)), tmp_path, startup_timeout_s=0.2
        ):
            pytest.fail("a server became healthy in 0.2s")
    assert set(_children_running_engines_local()) <= before


def _children_running_engines_local() -> list[int]:
    """Our own child processes still alive (any server this test process started)."""
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == me and b"engines.local" in cmdline:
            found.append(int(entry.name))
    return found


async def test_a_second_launch_in_the_same_log_dir_ignores_the_first_servers_ready_line(
    model_dir: Path, tmp_path: Path
) -> None:
    # a resumed run reuses its run directory, so the appended log holds an old ready line
    async with launch_local_engines(1, model_dir, tmp_path, startup_timeout_s=STARTUP_S) as first:
        pass
    with trio.fail_after(STARTUP_S):
        async with launch_local_engines(
            1, model_dir, tmp_path, startup_timeout_s=STARTUP_S
        ) as second:
            async with InferenceClient(second, api_key=second.api_key) as client:
                completion = await client.generate([5, 6], SamplingParams(max_tokens=1, seed=0))
    assert completion.finish_reason == "length"
    assert (tmp_path / "engine-0.log").read_text().count("ENGINE_READY") == 2
    del first


async def test_each_started_server_gets_its_device_and_a_cuda_one_refuses_here(
    tmp_path: Path,
) -> None:
    """``devices`` gives server I its device: a ``cpu`` one serves, and (on a machine without
    CUDA) a ``cuda:1`` one (``--device cuda``, seeing GPU 1 alone) exits at once saying why."""
    if torch.cuda.device_count() > 1:
        pytest.skip("checks the refusal on a machine without a second GPU")
    devices = ["cpu", "cuda:1"]
    with pytest.raises(EngineStartError) as info:
        async with open_engine_processes(
            2, ReferenceServers(devices=tuple(devices)), tmp_path, startup_timeout_s=STARTUP_S
        ):
            pytest.fail("a server on a CUDA device this machine lacks started")
    assert info.value.url.startswith("engine-1 ")
    assert "ConfigError: --device cuda but " in info.value.log_tail, info.value.log_tail


def test_a_server_on_gpu_n_sees_that_gpu_alone() -> None:
    """vLLM's way: CUDA_VISIBLE_DEVICES, so the server's weight-transfer group and buffers
    land on its GPU (an index-less CUDA device in the server means its only GPU)."""
    assert server_device(None, {}) == ([], {})
    assert server_device("cpu", {"A": "1"}) == (["--device", "cpu"], {})
    assert server_device("cuda", {}) == (["--device", "cuda"], {})
    assert server_device("cuda:2", {}) == (["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": "2"})
    # the index counts the GPUs this process sees
    assert server_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "4,6"}) == (
        ["--device", "cuda"],
        {"CUDA_VISIBLE_DEVICES": "6"},
    )
