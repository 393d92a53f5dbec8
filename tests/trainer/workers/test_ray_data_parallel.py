"""Data-parallel Ray ranks (real actors, a real gloo group) compute what one worker computes:
gradients of policy and critic, importance ratios, FSDP2 steps; the batch is pickled for them
off the trio thread."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from sync.transports.inprocess import copy_weights
from tests.trainer.helpers import assert_same_adam_step
from tests.trainer.workers.ray_helpers import POLICY_KWARGS, flat_grad, make_batch, wait_gone
from trainer.algorithms import RolloutCorrection
from trainer.vocabulary import wait_refs
from trainer.workers.batch import TrainBatch
from trainer.workers.critic import CriticWorker
from trainer.workers.lora import LoraSpec
from trainer.workers.policy import PolicyWorker
from trainer.workers.ray_group import RayWorkerGroup


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
        "rollout_correction": RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0),
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
        sharded=True,  # the plan's decision for workers.data_parallel=fsdp2
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


async def test_lora_ranks_reduce_the_adapters_gradient_and_rank0_reads_merged_weights(
    ray_cluster, model_dir
):
    """A LoRA policy on two replicated ranks: the all-reduced gradient is the adapter's alone
    and one worker's of the whole batch; after the step, what a transport reads on rank 0 is
    the single worker's merged weights, by the base model's names."""
    kwargs = POLICY_KWARGS | {"lora": LoraSpec(rank=4, alpha=8)}
    batch = make_batch(model_dir)
    single = PolicyWorker(model_dir, **kwargs)
    single.forward_backward(batch, batch.counts)
    expected = torch.cat(
        [p.grad.reshape(-1) for p in single.model.parameters() if p.requires_grad]  # type: ignore[union-attr]
    )
    single.optim_step()
    group = await RayWorkerGroup.create(
        model_dir, policy_kwargs=kwargs, with_ref=False, num_workers=2
    )
    try:
        await group.forward_backward(batch, batch.counts)
        reduced = await wait_refs([a.reduce_gradients.remote() for a in group.policy])
        for flat in reduced:
            assert flat.numel() == expected.numel()  # the adapter's parameters only
            torch.testing.assert_close(flat, expected, rtol=1e-4, atol=1e-6)
        await group.optim_step()
        merged = await group.run_on_rank0(copy_weights)
        want = dict(single.readable_model().named_parameters())
        assert list(merged) == list(want)
        for name, w in want.items():
            torch.testing.assert_close(merged[name], w, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        await group.shutdown()
    assert await wait_gone(list(group.pids.values())) == []
