"""``workers.backend=ray``: real actors, a real gloo group, real hangs and deaths."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
import trio

from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.local.model_weights import state_checksum
from engines.models import resolve_model_path
from sync.transports import DiskTransport
from sync.transports.broadcast import BroadcastTransport
from sync.transports.inprocess import copy_weights
from sync.weights import save_weights_for_sampler
from tests.e2e.helpers import alive_after, run_in_own_ray_cluster
from tests.trainer.helpers import assert_same_adam_step
from trainer.checkpoint import CheckpointManager
from trainer.config import load_config
from trainer.errors import (
    CheckpointEngineInitError,
    ConfigError,
    FaultInjected,
    RayClusterStartError,
    StepTimeoutError,
    WorkerError,
)
from trainer.vocabulary import FAULTS_ENV, Timer, install_faults, step_deadline, wait_refs
from trainer.workers.batch import TrainBatch
from trainer.workers.critic import CriticWorker
from trainer.workers.policy import PolicyWorker
from trainer.workers.ray_group import RayWorkerGroup
from trainer.workers.ray_placement import bundles, gpus_for, shards

POLICY_KWARGS: dict[str, Any] = dict(lr=1e-3, max_grad_norm=1e9, seed=0)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(None)


def make_batch(model_dir: Path, rows: int = 5, width: int = 12, seed: int = 0) -> TrainBatch:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    attn[0, -3:] = 0  # a padded row
    mask = torch.zeros(rows, width - 1)
    mask[:, 4:] = 1.0
    mask[0, -3:] = 0.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(rows, width - 1, generator=g),
    )


async def wait_gone(pids: list[int]) -> list[int]:
    """Of ``pids``, those still alive after a bounded wait (the actors' processes exit)."""
    return await trio.to_thread.run_sync(alive_after, pids, 30.0)


def test_local_backend_with_two_workers_is_a_config_error_saying_why():
    with pytest.raises(ConfigError, match=r"backend='local' runs exactly 1 policy worker"):
        load_config(None, ["workers.num_policy_workers=2"])
    cfg = load_config(None, ["workers.backend=ray", "workers.num_policy_workers=2"])
    assert (cfg.workers.backend, cfg.workers.num_policy_workers) == ("ray", 2)


def test_cluster_start_error_is_picklable_and_names_every_attempt():
    err = RayClusterStartError(None, 2, ["Exception: node timed out", "Exception: again"])
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err)
    assert "attempt 1: Exception: node timed out; attempt 2: Exception: again" in str(err)


def test_shards_cover_every_row_once():
    assert shards(5, 2) == [slice(0, 3), slice(3, 5)]
    assert shards(1, 3) == [slice(0, 1), slice(1, 1), slice(1, 1)]


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


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]


async def test_dp_gradients_of_policy_and_critic_equal_a_single_workers(ray_cluster, model_dir):
    """Both models of a PPO run: each rank's share of the mini-batch's loss, summed over the
    ranks, is one worker's gradient of the whole batch; the policy's weights stay identical
    across the ranks step after step."""
    batch = make_batch(model_dir)
    g = torch.Generator().manual_seed(3)
    batch.values = torch.randn(batch.loss_mask.shape, generator=g)
    batch.returns = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    single = PolicyWorker(model_dir, **POLICY_KWARGS)
    single.forward_backward(batch, batch.counts)
    expected = flat_grad(single.model)
    critic_kwargs = {"model_dir": str(model_dir), "lr": 1e-3, "max_grad_norm": 1e9, "seed": 0}
    critic = CriticWorker(**critic_kwargs)
    critic_metrics = critic.forward_backward(batch, batch.counts)

    group = await RayWorkerGroup.create(
        model_dir,
        policy_kwargs=POLICY_KWARGS,
        with_ref=False,
        num_workers=2,
        critic_kwargs=critic_kwargs,
    )
    try:
        assert (await group.compute_values(batch)).shape == batch.loss_mask.shape
        merged = await group.critic_forward_backward(batch, batch.counts)
        for key, value in critic_metrics.items():  # the ranks' shares add up
            assert merged[key] == pytest.approx(value, rel=1e-4), key
        reduced = await wait_refs([a.reduce_gradients.remote("critic") for a in group.policy])
        for flat in reduced:  # the same fresh head on every rank, the whole batch's gradient
            torch.testing.assert_close(flat, flat_grad(critic.model), rtol=1e-4, atol=1e-6)
        stepped = await group.critic_optim_step()
        assert stepped["critic/grad_norm"] == pytest.approx(float(reduced[0].norm()), rel=1e-4)

        await group.forward_backward(batch, batch.counts)
        reduced = await wait_refs([a.reduce_gradients.remote() for a in group.policy])
        for flat in reduced:  # every rank holds the whole batch's gradient
            torch.testing.assert_close(flat, expected, rtol=1e-4, atol=1e-6)
        metrics = await group.optim_step()
        assert metrics["policy/grad_norm"] == pytest.approx(float(expected.norm()), rel=1e-4)
        for step in range(1, 3):  # identical weights after each step
            rank0, rank1 = await group.rank_weights()
            for name, w in rank0.items():
                assert torch.equal(w, rank1[name]), (step, name)
            b = make_batch(model_dir, seed=step)
            await group.forward_backward(b, b.counts)
            await group.optim_step()
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []


async def test_dp_ranks_get_rollout_logprobs_and_tis_matches_a_single_worker(
    ray_cluster, model_dir
):
    """The batch travels pickled to the actors, one shard per rank: the rollout logprobs
    must arrive with it, or ``tis`` raises there (and ``none`` loses its ratio metrics). With a
    loss and an aggregation other than the defaults (CISPO, one mean per sequence): the
    ranks' gradients, each normalized by the whole batch's counts, add up to one worker's."""
    kwargs = POLICY_KWARGS | {
        "off_policy_correction": "tis",
        "tis_cap": 2.0,
        "policy_loss": "cispo",
        "loss_agg_mode": "seq-mean-token-mean",
    }
    batch = make_batch(model_dir)
    assert batch.old_logprobs is not None
    # rows 0-2 (rank 0's shard) sampled by a lagging policy: ratio 3, capped to 2
    lag = torch.tensor([1.0986123] * 3 + [0.0] * 2)[:, None]  # ln 3
    batch.rollout_logprobs = (batch.old_logprobs - lag) * batch.loss_mask
    single = PolicyWorker(model_dir, **kwargs)
    expected_metrics = single.forward_backward(batch, batch.counts)
    expected = torch.cat([p.grad.reshape(-1) for p in single.model.parameters()])  # type: ignore[union-attr]

    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=kwargs, with_ref=False, num_workers=2
    )
    try:
        metrics = await group.forward_backward(batch, batch.counts)
        reduced = await wait_refs([a.reduce_gradients.remote() for a in group.policy])
        for flat in reduced:
            torch.testing.assert_close(flat, expected, rtol=1e-4, atol=1e-6)
        for key in ("is_ratio_mean", "is_ratio_max", "is_ratio_min", "is_truncated_frac"):
            assert metrics[f"policy/{key}"] == pytest.approx(
                expected_metrics[f"policy/{key}"], rel=1e-5
            ), key
        assert metrics["policy/is_ratio_max"] == pytest.approx(3.0, rel=1e-5)
        assert 0 < metrics["policy/is_truncated_frac"] < 1
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
        async with launch_local_engines(1, model_dir, tmp_path, startup_timeout_s=180) as urls:
            async with InferenceClient(urls) as client:

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
                    result = await save_weights_for_sampler(client, group, transport)
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
        async with launch_local_engines(1, model_dir, tmp_path, startup_timeout_s=180) as urls:
            async with InferenceClient(urls) as client:
                transport = BroadcastTransport(2**20, group_init_timeout_s=3)
                with pytest.raises(CheckpointEngineInitError) as info:
                    await transport.init(client, group)
                assert (info.value.group, info.value.timeout_s) == ("weight_sync", 3)
                assert not transport.initialized
    finally:
        await group.shutdown()  # kills the actor still blocked in its join
    assert await wait_gone(list(group.pids.values())) == []


async def test_actor_hung_in_backload_times_out_with_the_steps_error(ray_cluster, model_dir):
    install_faults("backload_to_gpu:hang@3")
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=True, num_workers=2
    )
    try:
        with pytest.raises(StepTimeoutError) as info:
            with step_deadline(3, 4.0):
                with Timer("train_critic_and_policy"):
                    await group.backload_to_gpu()
        assert info.value.step == 3
        assert info.value.stage == "train_critic_and_policy"
        assert info.value.operation == "backload_to_gpu"
        # the ranks really are stuck (a Ray actor runs one call at a time): only a kill ends them
        ready, _ = ray.wait([group.policy[0].pid.remote()], timeout=1.0)
        assert ready == []
    finally:
        with trio.fail_after(60):
            await group.shutdown()
    assert set(group.pids) == {"policy:0", "policy:1", "ref:0"}
    assert await wait_gone(list(group.pids.values())) == []


async def test_killed_worker_is_a_worker_error_naming_it_within_the_budget(
    ray_cluster, model_dir, tmp_path
):
    # each rank appends the fault to this log when it fires: both are then inside the call
    fired = tmp_path / "faults_fired.log"
    install_faults("forward_backward:sleep=60", fired_log=fired)
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=2
    )
    batch = make_batch(model_dir)
    started = time.monotonic()
    try:
        caught: list[WorkerError] = []
        with step_deadline(1, 50.0):
            with Timer("train_critic_and_policy"):
                async with trio.open_nursery() as nursery:

                    async def kill_rank_1() -> None:
                        with trio.fail_after(40):  # both ranks are stuck in forward_backward
                            # the event happens in other processes: poll the file they append to
                            while len(fired.read_text().splitlines()) < 2:  # noqa: ASYNC110
                                await trio.sleep(0.05)
                        await trio.to_thread.run_sync(ray.kill, group.policy[1])

                    nursery.start_soon(kill_rank_1)
                    try:
                        await group.forward_backward(batch, batch.counts)
                    except WorkerError as exc:
                        caught.append(exc)
        assert len(caught) == 1
        err = caught[0]
        assert time.monotonic() - started < 50.0
        assert (err.worker, err.rank) == ("policy", 1)
        assert err.stage == "train_critic_and_policy"
        assert "actor died" in err.detail
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []


async def test_remote_error_of_our_class_arrives_as_itself_with_the_remote_traceback(
    ray_cluster, model_dir
):
    install_faults("optim_step:error=boom")
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=1
    )
    try:
        with pytest.raises(FaultInjected) as info:
            await group.optim_step()
        assert info.value.message == "boom"
        assert any("remote traceback (policy rank 0)" in n for n in info.value.__notes__)
    finally:
        await group.shutdown()


async def test_remote_foreign_error_becomes_worker_error_with_traceback(ray_cluster, model_dir):
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=False, num_workers=1
    )
    bad = make_batch(model_dir)
    bad.input_ids = bad.input_ids + 10_000  # out of the vocabulary: IndexError in the actor
    try:
        with Timer("fwd_logprobs_values_reward"):
            with pytest.raises(WorkerError) as info:
                await group.compute_logprobs(bad)
        assert (info.value.worker, info.value.rank) == ("policy", 0)
        assert info.value.stage == "fwd_logprobs_values_reward"
        assert "IndexError" in info.value.detail
        assert "ray::PolicyActor.compute_logprobs" in info.value.detail  # remote traceback
    finally:
        await group.shutdown()
    assert os.environ.get(FAULTS_ENV) is None


def test_gpus_per_worker_follows_the_key_then_the_device():
    assert gpus_for(0.5, "cpu") == 0.5
    assert gpus_for(None, "cuda") == 1.0
    assert gpus_for(None, "cpu") == 0.0


def test_a_reference_model_on_gpus_has_its_own_bundle_in_the_group():
    """Placed with the policy or not at all: never a policy whose reference waits for a GPU."""
    assert bundles(2, 1.0, True) == [{"CPU": 1.0, "GPU": 1.0}] * 2 + [{"GPU": 1.0}]
    assert bundles(2, 0.5, False) == [{"CPU": 1.0, "GPU": 0.5}] * 2
    assert bundles(2, 0.0, True) == [{"CPU": 1.0}] * 2  # on the CPU it needs no bundle


#: A cluster of its own with 3 logical GPUs: 2 policy ranks and the reference, one GPU each.
_GPU_GROUP = """
import json, os, sys, trio, ray
from trainer.workers.ray_cluster import actor_env, init_kwargs, prepare_env
from trainer.workers.ray_group import RayWorkerGroup

prepare_env()
ray.init(**init_kwargs(None, num_cpus=4), num_gpus=3)

def visible(model):
    return os.environ.get("CUDA_VISIBLE_DEVICES")

async def main():
    kwargs = {"lr": 1e-3, "seed": 0, "device": "cpu"}
    group = await RayWorkerGroup.create(
        sys.argv[1], policy_kwargs=kwargs, with_ref=True, num_workers=2, gpus_per_worker=1.0
    )
    try:
        rank0 = await group.run_on_rank0(visible)
        print("RESULT " + json.dumps({"names": sorted(group.pids), "rank0": rank0,
              "free_gpus": ray.available_resources().get("GPU", 0)}))
    finally:
        await group.shutdown()

trio.run(main)
ray.shutdown()
"""


def test_policy_ranks_and_the_reference_are_placed_on_their_gpus_together(model_dir):
    """Logical GPUs (Ray assigns them on a CPU machine as on a GPU one): the three actors are
    placed from one placement group, rank 0 sees its one GPU, none is left over."""
    result = run_in_own_ray_cluster(_GPU_GROUP, str(model_dir), timeout_s=300)
    assert result["names"] == ["policy:0", "policy:1", "ref:0"]
    assert result["rank0"] is not None and len(result["rank0"].split(",")) == 1
    assert result["free_gpus"] == 0


async def test_fsdp2_ranks_step_like_one_worker_and_rank0_reads_the_full_weights(
    ray_cluster, model_dir
):
    """workers.data_parallel=fsdp2 on the CPU (gloo): 5 rows over 2 ranks, padded to 3 each."""
    batch = make_batch(model_dir)
    single = PolicyWorker(model_dir, **POLICY_KWARGS)
    expected_logprobs = single.compute_logprobs(batch)
    batch.old_logprobs = expected_logprobs
    single.forward_backward(batch, batch.counts)
    single.optim_step()
    expected = {n: p.detach() for n, p in single.model.named_parameters()}

    group = await RayWorkerGroup.create(
        model_dir,
        policy_kwargs=POLICY_KWARGS,
        with_ref=False,
        num_workers=2,
        data_parallel="fsdp2",
    )
    try:
        assert group.sharded
        logprobs = await group.compute_logprobs(batch)
        torch.testing.assert_close(logprobs, expected_logprobs, rtol=1e-5, atol=1e-5)
        assert await group.backload_to_gpu() == {"workers/backload_bytes": 0.0}
        await group.forward_backward(batch, batch.counts)
        await group.optim_step()
        assert await group.offload_to_cpu() == {"workers/offload_bytes": 0.0}
        full = await group.run_on_rank0(copy_weights)
        assert_same_adam_step(full, expected, lr=POLICY_KWARGS["lr"])
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []


async def test_the_batch_is_serialised_for_the_actors_off_the_trio_thread(
    ray_cluster, model_dir, monkeypatch
):
    """Submitting a call pickles its arguments (the batch's tensors) where ``.remote`` runs:
    on the trio thread, a large batch would stall every rollout in flight (DESIGN 3 rule 1)."""
    pickled_on: list[int] = []
    real = TrainBatch.__getstate__

    def recording(self: TrainBatch) -> Any:
        pickled_on.append(threading.get_ident())
        return real(self)

    monkeypatch.setattr(TrainBatch, "__getstate__", recording)
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=POLICY_KWARGS, with_ref=True, num_workers=2
    )
    try:
        batch = make_batch(model_dir)
        await group.compute_logprobs(batch)
        await group.compute_ref_logprobs(batch)
        await group.forward_backward(batch, batch.counts)
    finally:
        await group.shutdown()
    # two ranks' shards for the forward and the update, the whole batch for the reference
    assert len(pickled_on) == 5
    assert threading.get_ident() not in pickled_on
