"""Ray workers that hang, die or raise: real hangs and deaths, each a typed error naming the
step, the stage, the worker and its rank, with the remote traceback."""

from __future__ import annotations

import os
import time

import pytest
import ray
import trio

from tests.trainer.workers.ray_helpers import POLICY_KWARGS, make_batch, wait_gone
from trainer.errors import FaultInjected, StepTimeoutError, WorkerError
from trainer.vocabulary import FAULTS_ENV, Timer, install_faults, step_deadline
from trainer.workers.ray_group import RayWorkerGroup


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
