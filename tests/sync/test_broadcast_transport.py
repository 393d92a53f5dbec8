"""The broadcast transport through real reference servers and a real gloo group."""

from __future__ import annotations

import pytest
import torch
import trio

from engines.client import ControlRoutes, InferenceClient
from engines.launch import launch_local_engines
from engines.local.model_weights import state_checksum
from engines.models import build_tiny_model
from engines.types import SamplingParams
from sync.transports import broadcast_rank0 as broadcast
from sync.transports.broadcast import BroadcastTransport
from sync.weights import sync_weights
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import install_faults
from trainer.workers.local import LocalWorkerGroup


def hosted_group(transport: BroadcastTransport) -> object:
    """Rank 0's membership in the transport's group, as this process holds it (local workers)."""
    return broadcast.hosted_groups().get(transport.group_id)


async def _checksums(client: InferenceClient, key: str = "checksum") -> list[str]:
    answers = await client.control("POST", "/weight_checker", json={"action": "checksum"})
    return [a[key] for a in answers]


async def test_broadcast_sync_makes_every_engine_serve_exactly_the_policy_weights(tmp_path):
    model_dir = build_tiny_model()
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    async with launch_local_engines(2, model_dir, tmp_path / "logs", startup_timeout_s=180) as urls:
        async with InferenceClient(urls, api_key=urls.api_key) as client:
            # a small bucket size: several /update_weights calls, applied together at finish
            transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120)
            await transport.init(client, workers)
            group = hosted_group(transport)
            assert group is not None
            await transport.init(client, workers)  # built once, reused
            assert hosted_group(transport) is group
            model = workers.policy.model
            for sync in range(3):
                with torch.no_grad():  # the policy moves away from what the engines serve
                    for p in model.parameters():
                        p.add_(0.01 * torch.randn_like(p))
                if sync == 2:  # new storage (as a device move would): re-homed, still exact
                    p.data = p.data.clone()
                policy_sum = state_checksum(dict(model.named_parameters()))
                assert policy_sum not in await _checksums(client)
                version = 10 + sync  # the trainer's, which each engine takes as its own
                result = await sync_weights(client, workers, transport, weight_version=version)
                assert await _checksums(client) == [policy_sum, policy_sum]
                assert await _checksums(client, "weight_version") == [version, version]
                assert result["sync/last_weight_sync_seconds"] > 0
                # packed on the CPU: every bucket went out as a slice of one buffer
                assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
            assert not any(await client.is_paused())  # the bracket resumed generation
            completion = await client.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=0))
            assert completion.finish_reason in ("stop", "length")
            await transport.close(workers)
            assert hosted_group(transport) is None and not transport.initialized


async def test_a_join_that_hangs_gives_checkpoint_engine_init_error(tmp_path):
    model_dir = build_tiny_model()
    # the join hangs where it runs: the server's join thread (it inherits TRAINER_FAULTS)
    # and rank 0's thread here
    install_faults("init_process_group:hang")
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    async with launch_local_engines(1, model_dir, tmp_path / "logs", startup_timeout_s=180) as urls:
        async with InferenceClient(urls, api_key=urls.api_key) as client:
            transport = BroadcastTransport(2**20, group_init_timeout_s=2)
            with pytest.raises(CheckpointEngineInitError) as info:
                await transport.init(client, workers)
            assert info.value.group == "weight_sync" and info.value.timeout_s == 2
            assert hosted_group(transport) is None and not transport.initialized


class SlowRank0:
    """Rank 0 that takes 6 s to say where it hosts, then never finishes joining."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def run_on_rank0(self, fn, *args, abandon_on_cancel: bool = False):
        self.calls.append(fn.__name__)
        if fn is broadcast.group_endpoint:
            await trio.sleep(6)
            return "127.0.0.1", 1
        await trio.sleep_forever()


class SilentServer(ControlRoutes):
    """An engine whose /init_weight_transfer_engine never answers."""

    urls = ("http://127.0.0.1:1",)

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def get_world_size(self) -> list[int]:
        return [1]

    async def control_one(self, url, method, path, params=None, json=None):
        self.calls.append(path)
        await trio.sleep_forever()

    async def control(self, method, path, params=None, json=None):
        return [await self.control_one(u, method, path, params, json) for u in self.urls]

    async def _unused(self, *args, **kwargs):
        raise AssertionError("a group init makes control calls only")

    generate = generate_n = max_model_len = _unused


async def test_the_whole_group_init_is_bounded_once_and_attempted_once(autojump_clock):
    rank0, server = SlowRank0(), SilentServer()
    transport = BroadcastTransport(2**20, group_init_timeout_s=10)
    t0 = trio.current_time()
    with pytest.raises(CheckpointEngineInitError) as info:
        await transport.init(server, rank0)
    # one bound for both phases: 10 s, not 6 s + 10 s
    assert trio.current_time() - t0 == pytest.approx(10)
    assert info.value.timeout_s == 10 and not transport.initialized
    # no retry in place: each participant was asked to join once
    assert rank0.calls == ["group_endpoint", "host_group"]
    assert server.calls == ["/init_weight_transfer_engine"]


def test_rank0_hosts_where_the_engines_reach_it() -> None:
    """Rank 0 in this process, whether or not a Ray driver runs here (the suite's cluster may
    be up in this worker): loopback engines (or none) give loopback, a remote engine this
    machine's address on the route to it; an explicit sync.master_address wins. (Rank 0 as a
    Ray actor hosts at its node's address: tests/trainer/workers/test_ray_rank0.py, whose
    server accepts that address alone.)"""
    assert broadcast.group_endpoint(None, None, ["127.0.0.1", "localhost"])[0] == "127.0.0.1"
    assert broadcast.group_endpoint(None, None, [])[0] == "127.0.0.1"
    outward = broadcast.route_address("192.0.2.1")  # TEST-NET-1: routed, never reached
    assert not broadcast.is_loopback(outward)
    assert broadcast.group_endpoint(None, None, ["192.0.2.1"])[0] == outward
    assert broadcast.group_endpoint(None, "127.0.0.1", ["192.0.2.1"])[0] == "127.0.0.1"
    with pytest.raises(RuntimeError, match=r"set sync\.master_address"):
        broadcast.route_address("no-such-host.invalid")
