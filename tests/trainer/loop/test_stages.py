"""``make_batch``: token-level tensors line up with the logprobs the workers compute."""

from __future__ import annotations

import pickle

import torch

from trainer.generators import Trajectory
from trainer.loop._stages import make_batch

PAD = 0


def test_rollout_logprobs_align_with_the_loss_mask_and_are_zero_off_it():
    # row 0: prompt [11, 12], model tokens 21, 22, an environment token 31 (loss mask 0,
    # logprob 0.0 as generators give it), then model token 23
    # row 1: prompt [13], one model token 24, then padding
    multi_turn = Trajectory(
        prompt_ids=[11, 12],
        response_ids=[21, 22, 31, 23],
        loss_mask=[1, 1, 0, 1],
        reward=1.0,
        rollout_logprobs=[-0.1, -0.2, 0.0, -0.3],
        group_id=0,
    )
    short = Trajectory(
        prompt_ids=[13],
        response_ids=[24],
        loss_mask=[1],
        reward=0.0,
        rollout_logprobs=[-0.4],
        group_id=0,
    )
    batch = make_batch([multi_turn, short], PAD)
    assert batch.input_ids.tolist() == [[11, 12, 21, 22, 31, 23], [13, 24, PAD, PAD, PAD, PAD]]
    # position t predicts token t + 1: row 0's position 1 predicts 21, position 4 predicts 23
    assert batch.loss_mask.tolist() == [[0, 1, 1, 0, 1], [1, 0, 0, 0, 0]]
    expected = torch.tensor([[0.0, -0.1, -0.2, 0.0, -0.3], [-0.4, 0.0, 0.0, 0.0, 0.0]])
    assert batch.rollout_logprobs is not None
    torch.testing.assert_close(batch.rollout_logprobs, expected)
    # the same [B, L - 1] shape as the logprobs a worker computes from input_ids
    assert batch.rollout_logprobs.shape == (2, batch.input_ids.shape[1] - 1)


def test_a_generator_logprob_at_an_environment_token_does_not_reach_the_batch():
    traj = Trajectory(
        prompt_ids=[11],
        response_ids=[21, 31],
        loss_mask=[1, 0],
        reward=0.0,
        rollout_logprobs=[-0.5, -7.0],  # a generator that scored its tool output too
        group_id=0,
    )
    batch = make_batch([traj], PAD)
    assert batch.rollout_logprobs is not None
    assert batch.rollout_logprobs.tolist() == [[-0.5, 0.0]]


def test_select_and_pickling_carry_rollout_logprobs():
    """Ray sends each rank ``batch.select(rows)`` pickled: the field must survive both."""
    trajs = [
        Trajectory(
            prompt_ids=[11],
            response_ids=[20 + i],
            loss_mask=[1],
            reward=0.0,
            rollout_logprobs=[-0.1 * (i + 1)],
            group_id=0,
        )
        for i in range(3)
    ]
    batch = make_batch(trajs, PAD)
    part = pickle.loads(pickle.dumps(batch.select([2, 0])))
    assert part.rollout_logprobs is not None
    torch.testing.assert_close(part.rollout_logprobs, torch.tensor([[-0.3], [-0.1]]))
    sliced = batch.select(slice(1, 2))
    assert sliced.rollout_logprobs is not None
    torch.testing.assert_close(sliced.rollout_logprobs, torch.tensor([[-0.2]]))


def test_accuracy_counts_replies_paid_in_full_which_a_partial_credit_mean_hides():
    from trainer.data import Example
    from trainer.generators import GeneratorOutput
    from trainer.loop._stages import accuracy, rollout_metrics

    # reasoning-gym pays 0.4 for "The answer is 7." when the answer is 7: half the mean, no accuracy
    assert accuracy([1.0, 0.4, 0.4, 0.0]) == 0.25
    assert accuracy([0.9999, 0.5]) == 0.0 and accuracy([1.0, 2.0]) == 1.0
    out = GeneratorOutput(
        trajectories=[
            Trajectory(
                prompt_ids=[1],
                response_ids=[2],
                loss_mask=[1],
                reward=r,
                rollout_logprobs=[-0.1],
                group_id=0,
            )
            for r in (1.0, 0.4, 0.4, 0.0)
        ]
    )
    metrics = rollout_metrics([Example(({"role": "user", "content": "q"},), "7", 3)], out)
    assert (metrics["reward/mean"], metrics["reward/accuracy"]) == (0.45, 0.25)
