"""The KL in the reward (``algorithm.use_kl_in_reward``, verl's ``apply_kl_penalty``): the
per-token penalty and the step's KL, the fixed and adaptive controllers (Ziegler et al. 2019),
and the token-level rewards through each kind of advantage estimator, all hand-worked."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import (
    KlController,
    compute_advantages,
    gae_advantages_and_returns,
    kl_reward_penalty,
)

F64 = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_the_adaptive_coefficient_moves_as_ziegler_and_verl_by_hand():
    """coef 0.1, target 0.05, horizon 100, 10 trajectories a step.
    KL 0.08: e = clip(0.08 / 0.05 - 1 = 0.6, +-0.2) = 0.2; coef *= 1 + 0.2 * 10 / 100 = 1.02
    -> 0.102. KL 0.045: e = -0.1; coef *= 1 - 0.1 * 0.1 = 0.99 -> 0.10098.
    KL 0: e = clip(-1) = -0.2; coef *= 0.98 -> 0.0989604."""
    ctrl = KlController("adaptive", 0.1, target_kl=0.05, horizon=100)
    for kl, want in ((0.08, 0.102), (0.045, 0.10098), (0.0, 0.0989604)):
        ctrl.update(kl, n_steps=10)
        assert ctrl.coef == pytest.approx(want, rel=1e-12)
    fixed = KlController("fixed", 0.1, target_kl=0.05, horizon=100)
    fixed.update(0.08, n_steps=10)
    assert fixed.coef == 0.1
    with pytest.raises(ValueError, match="unknown kl_ctrl type 'pid'"):
        KlController("pid", 0.1)


def test_a_checkpointed_adaptive_coefficient_comes_back_and_a_fixed_one_stays_configured():
    saved = KlController("adaptive", 0.1, target_kl=0.05, horizon=100)
    saved.update(0.08, n_steps=10)
    resumed = KlController("adaptive", 0.1, target_kl=0.05, horizon=100)
    resumed.load_state_dict(saved.state_dict())
    assert resumed.coef == saved.coef == pytest.approx(0.102)
    fixed = KlController("fixed", 0.3)
    fixed.load_state_dict(saved.state_dict())
    assert fixed.coef == 0.3  # a fixed coefficient is the config's, changed on purpose or not


def test_the_penalty_and_the_steps_kl_by_hand():
    """old - ref: sequence 0 [0.5, -1] (its third token padding), sequence 1 [0] (one token).
    k1: per-sequence means -0.25 and 0; the step's KL (-0.25 + 0) / 2 = -0.125;
    the penalty -coef * kl with coef 0.2: [-0.1, 0.2, 0], [0, 0, 0].
    k3 = exp(-d) + d - 1: 0.5 -> 0.1065307, -1 -> e - 2 = 0.7182818; KL (0.4124062 + 0) / 2."""
    old = t([[-1.0, -2.0, 5.0], [-0.5, 9.0, 9.0]])
    ref = t([[-1.5, -1.0, 0.0], [-0.5, 0.0, 0.0]])
    mask = t([[1, 1, 0], [1, 0, 0]])
    penalty, kl = kl_reward_penalty(old, ref, mask, 0.2, "k1")
    assert kl == pytest.approx(-0.125, abs=1e-12)
    torch.testing.assert_close(penalty, t([[-0.1, 0.2, 0.0], [0.0, 0.0, 0.0]]))
    penalty, kl = kl_reward_penalty(old, ref, mask, 1.0, "k3")
    k3 = [math.exp(-0.5) - 0.5, math.e - 2]
    assert kl == pytest.approx(sum(k3) / 2 / 2, abs=1e-12)
    torch.testing.assert_close(penalty, t([[-k3[0], -k3[1], 0.0], [0.0, 0.0, 0.0]]))


def test_a_sequence_estimator_reads_the_outcome_plus_the_sum_of_the_token_rewards():
    """grpo without std: outcomes [1, 0] in one group, token rewards [-0.1, 0.2] and [0, (pad
    0.7, ignored)]: scores [1.1, 0], mean 0.55, advantages [0.55, -0.55] (verl's scores =
    token_level_rewards.sum(-1))."""
    mask = t([[1, 1], [1, 0]])
    adv = compute_advantages(
        t([1.0, 0.0]), [0, 0], "grpo", mask=mask, norm_by_std=False,
        token_rewards=t([[-0.1, 0.2], [0.0, 0.7]]),
    )  # fmt: skip
    torch.testing.assert_close(adv, t([0.55, -0.55]))


def test_reinforce_plus_plus_discounts_each_tokens_own_reward():
    """gamma 0.5, mask [1, 0, 1, 1] (an environment's token at 1), outcome 1, token rewards
    [-0.1, (99, not trained), -0.2, -0.3]: rewards per trained token [-0.1, -0.2, 0.7], returns
    0.7, -0.2 + 0.5 * 0.7 = 0.15, -0.1 + 0.5 * 0.15 = -0.025; whitened (mean 0.275, unbiased
    std 0.3783186): [-0.7929823, -0.3304093, 1.1233916], 0 at the environment's token."""
    adv = compute_advantages(
        t([1.0]), [0], "reinforce_plus_plus", mask=t([[1, 0, 1, 1]]), gamma=0.5,
        token_rewards=t([[-0.1, 99.0, -0.2, -0.3]]),
    )  # fmt: skip
    torch.testing.assert_close(
        adv, t([[-0.7929823, 0.0, -0.3304093, 1.1233916]]), atol=1e-7, rtol=0
    )


def test_gae_adds_the_token_rewards_to_each_steps_td_error():
    """gamma = lam = 1, values [0.5, 0.25], outcome 1, token rewards [-0.1, -0.2]:
    delta_1 = (-0.2 + 1) - 0.25 = 0.55 = A_1; delta_0 = -0.1 + 0.25 - 0.5 = -0.35,
    A_0 = -0.35 + 0.55 = 0.2; returns A + V = [0.7, 0.8] (the rewards' sums to the end)."""
    adv, ret = gae_advantages_and_returns(
        t([1.0]), t([[0.5, 0.25]]), torch.tensor([[True, True]]), 1.0, 1.0, t([[-0.1, -0.2]])
    )
    torch.testing.assert_close(adv, t([[0.2, 0.55]]))
    torch.testing.assert_close(ret, t([[0.7, 0.8]]))


def test_without_token_rewards_every_estimator_is_unchanged():
    mask = t([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    rewards, groups = t([1.0, 0.0, 0.5, 0.2]), [0, 0, 1, 1]
    zeros = torch.zeros_like(mask)
    for name in ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        plain = compute_advantages(rewards, groups, name, mask=mask)
        with_zero = compute_advantages(rewards, groups, name, mask=mask, token_rewards=zeros)
        torch.testing.assert_close(plain, with_zero, rtol=0, atol=1e-15)
    with pytest.raises(ValueError, match="token_rewards must be"):
        compute_advantages(rewards, groups, "grpo", mask=mask, token_rewards=zeros[:, :2])
