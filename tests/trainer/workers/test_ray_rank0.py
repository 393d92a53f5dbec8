"""What rank 0's Ray actor does for the run: writes the checkpoint every rank loads back, and
hosts the weight syncs into a real reference server (disk buckets, the broadcast group, a join
that hangs)."""

from __future__ import annotations

import pytest
import ray
import torch
import trio

from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.local.model_weights import state_checksum
from sync.transports import DiskTransport
from sync.transports.broadcast import BroadcastTransport
from sync.transports.inprocess import copy_weights
from sync.weights import sync_weights
from tests.trainer.workers.ray_helpers import POLICY_KWARGS, make_batch, wait_gone
from trainer.checkpoint import CheckpointManager
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import install_faults
from trainer.workers.ray_group import RayWorkerGroup


async def node_address() -> tuple[str]:
    """Where rank 0's actor hosts the weight-sync group (its node's Ray address): the one
    ``master_address`` the server is told to accept, as the trainer tells its own servers."""
    return (str(await trio.to_thread.run_sync(ray.util.get_node_ip_address)),)


async def test_rank_0_writes_the_checkpoint_through_the_managers_save(
    ray_cluster, model_dir, tmp_path
):
    """The run hands the workers ``CheckpointManager.save``; it travels to rank 0's actor,
    which writes a complete, verified checkpoint that every rank loads back."""
    ckpt = CheckpointManager(tmp_path / "checkpoints", max_to_keep=1)
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=2
    )
    try:
        batch = make_batch(model_dir)
        await group.forward_backward(batch, batch.counts)
        await group.optim_step()
        saved, _ = await group.rank_weights()
        path = await group.save_checkpoint(ckpt.save, 1, {"data": 7})
        assert path == ckpt.step_dir(1) and ckpt.resolve("latest") == path  # verified
        state = ckpt.read_trainer_state(path)
        assert (state["step"], state["data"]) == (1, 7)
        later = make_batch(model_dir, seed=1)
        await group.forward_backward(later, later.counts)
        await group.optim_step()
        assert not all(torch.equal(w, saved[n]) for n, w in (await group.rank_weights())[0].items())
        await group.load_checkpoint(path)
        for weights in await group.rank_weights():
            for name, w in weights.items():
                assert torch.equal(w, saved[name]), name
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []


async def test_disk_and_broadcast_syncs_from_ray_ranks_make_the_engine_serve_rank_0s_weights(
    ray_cluster, model_dir, tmp_path
):
    """Both transports with Ray workers: rank 0's actor writes the disk buckets, then hosts
    the weight-sync group (beside the data-parallel group) and broadcasts to a real server."""
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=2
    )
    try:
        async with launch_local_engines(
            1,
            model_dir,
            tmp_path,
            startup_timeout_s=180,
            weight_dir=tmp_path / "sync",
            weight_sync_hosts=await node_address(),
        ) as urls:
            async with InferenceClient(urls, api_key=urls.api_key) as client:

                async def served() -> str:
                    (answer,) = await client.control(
                        "POST", "/weight_checker", json={"action": "checksum"}
                    )
                    return answer["checksum"]

                # small buckets: several per sync, applied together at finish
                transports = [
                    DiskTransport(tmp_path / "sync", bucket_bytes=64 * 1024),
                    BroadcastTransport(64 * 1024, group_init_timeout_s=120),
                ]
                for seed, transport in enumerate(transports):
                    b = make_batch(model_dir, seed=seed)
                    await group.forward_backward(b, b.counts)
                    await group.optim_step()  # the policy moves away from what is served
                    policy_sum = state_checksum(await group.run_on_rank0(copy_weights))
                    assert await served() != policy_sum
                    await transport.init(client, group)
                    result = await sync_weights(client, group, transport)
                    assert await served() == policy_sum, type(transport).__name__
                    assert result["sync/last_weight_sync_seconds"] > 0
                    assert not any(await client.is_paused())
                    await transport.close(group)  # rank 0's actor leaves the group
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []


async def test_a_hung_weight_sync_join_in_rank_0s_actor_is_checkpoint_engine_init_error(
    ray_cluster, model_dir, tmp_path
):
    install_faults("init_process_group:hang")  # rank 0's actor and the server both hang
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=1
    )
    try:
        async with launch_local_engines(
            1, model_dir, tmp_path, startup_timeout_s=180, weight_sync_hosts=await node_address()
        ) as urls:
            async with InferenceClient(urls, api_key=urls.api_key) as client:
                transport = BroadcastTransport(2**20, group_init_timeout_s=3)
                with pytest.raises(CheckpointEngineInitError) as info:
                    await transport.init(client, group)
                assert (info.value.group, info.value.timeout_s) == ("weight_sync", 3)
                assert not transport.initialized
    finally:
        await group.shutdown()  # kills the actor still blocked in its join
    assert await wait_gone(list(group.pids.values())) == []
