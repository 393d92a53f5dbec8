"""GAE and the critic's clipped value loss against values worked out by hand, and the value
loss's exactness under micro-batches (the critic's gradient summed over parts equals one call's)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import (
    BatchCounts,
    compute_advantages,
    explained_variance,
    gae_advantages_and_returns,
    value_loss,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_gae_with_gamma_and_lambda_one_is_the_reward_less_each_value():
    # one trajectory, three trained tokens, values 0.5 0.2 0.1, reward 1 on the last token:
    # t=2: delta = 1 - 0.1 = 0.9; t=1: -0.1 + 0.9 = 0.8; t=0: -0.3 + 0.8 = 0.5 (= 1 - V_t);
    # every return is the reward, 1.
    mask = torch.ones(1, 3, dtype=torch.bool)
    adv, ret = gae_advantages_and_returns(t([1.0]), t([[0.5, 0.2, 0.1]]), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.8, 0.9]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_discounts_over_trained_tokens_and_skips_the_others():
    # positions: prompt (untrained), trained, an environment's token, trained, padding; the
    # untrained positions' values (9, 7, 5) must not count. gamma 0.9, lam 0.5, reward 2:
    # t=3 (last trained): delta = 2 + 0 - 0.2 = 1.8, A = 1.8, R = 2.0
    # t=1: delta = 0 + 0.9 * 0.2 - 0.4 = -0.22, A = -0.22 + 0.9 * 0.5 * 1.8 = 0.59, R = 0.99
    mask = torch.tensor([[False, True, False, True, False]])
    values = t([[9.0, 0.4, 7.0, 0.2, 5.0]])
    adv, ret = gae_advantages_and_returns(t([2.0]), values, mask, 0.9, 0.5)
    torch.testing.assert_close(adv, t([[0.0, 0.59, 0.0, 1.8, 0.0]]))
    torch.testing.assert_close(ret, t([[0.0, 0.99, 0.0, 2.0, 0.0]]))
    # the estimator whitens over the batch's trained tokens: mean 1.195, unbiased var
    # 2 * 0.605^2 = 0.73205, so -+0.605 / sqrt(0.73205 + 1e-8)
    whitened = compute_advantages(
        t([2.0]), [0], "gae", mask=mask, values=values, gamma=0.9, lam=0.5
    )
    s = 0.605 / math.sqrt(0.73205 + 1e-8)
    torch.testing.assert_close(whitened, t([[0.0, -s, 0.0, s, 0.0]]))


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    # lam 0: A_t = r_t + gamma * V_next - V_t. Two rows of different lengths (the second has
    # one trained token): row 0 t=1: 1 - 0.3 = 0.7, t=0: 0.5 * 0.3 - 0.6 = -0.45; row 1: 0 - 0.2
    mask = torch.tensor([[True, True], [True, False]])
    adv, ret = gae_advantages_and_returns(
        t([1.0, 0.0]), t([[0.6, 0.3], [0.2, 4.0]]), mask, 0.5, 0.0
    )
    torch.testing.assert_close(adv, t([[-0.45, 0.7], [-0.2, 0.0]]))
    torch.testing.assert_close(ret, t([[0.15, 1.0], [0.0, 0.0]]))


def test_gae_needs_the_critics_values_and_the_mask():
    mask = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="reads a critic's values: pass values="):
        compute_advantages(t([1.0]), [0], "gae", mask=mask)
    with pytest.raises(ValueError, match=r"values must be \[B, T\] like mask"):
        compute_advantages(t([1.0]), [0], "gae", mask=mask, values=torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
        compute_advantages(t([1.0]), [0], "gae", mask=mask, values=torch.zeros(1, 2), lam=1.5)


def test_the_clipped_value_loss_by_hand():
    # token 0: v 1.0, v_old 0.5, R 2: unclipped (1 - 2)^2 = 1, clipped v_old + 0.2 = 0.7:
    #   (0.7 - 2)^2 = 1.69, the larger (clipped). token 1: v 0.6, v_old 0.5, R 0: inside the
    #   clip range, both 0.36 (not counted as clipped). loss 0.5 * (1.69 + 0.36) / 2 = 0.5125
    values = torch.tensor([[1.0, 0.6]], requires_grad=True)
    old, returns, mask = t([[0.5, 0.5]]).float(), t([[2.0, 0.0]]).float(), torch.ones(1, 2)
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    assert loss.item() == pytest.approx(0.5125)
    assert metrics == pytest.approx({"vf_loss": 0.5125, "vf_clip_frac": 0.5, "vpred_mean": 0.8})
    loss.backward()
    # token 0's clipped term is flat in v: no gradient; token 1: 0.5 * 2 * 0.6 / 2 = 0.3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.3]]))
    unclipped, m = value_loss(values.detach(), old, returns, mask, clip=None)
    assert unclipped.item() == pytest.approx(0.5 * (1.0 + 0.36) / 2)
    assert m["vf_clip_frac"] == 0.0


def test_the_value_loss_is_exact_under_micro_batches():
    torch.manual_seed(0)
    values = torch.randn(4, 5, requires_grad=True)
    old, returns = torch.randn(4, 5), torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    counts = BatchCounts.of(mask)
    whole, _ = value_loss(values, old, returns, mask, clip=0.2)
    (full,) = torch.autograd.grad(whole, values)
    parts = [
        value_loss(values[s], old[s], returns[s], mask[s], clip=0.2, counts=counts)[0]
        for s in (slice(0, 1), slice(1, 4))
    ]
    (summed,) = torch.autograd.grad(sum(parts), values)
    torch.testing.assert_close(summed, full)
    assert sum(p.item() for p in parts) == pytest.approx(whole.item())


def test_explained_variance():
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0, abs=1e-4)
    mean = torch.full_like(returns, 2.0)  # no better than the mean: 0
    assert explained_variance(mean, returns, mask) == pytest.approx(0.0, abs=1e-4)
    # residuals 1, 1, -2: var 3 against var 1: 1 - 3 / (1 + 1e-5)
    worse = torch.tensor([[0.0, 1.0, 5.0, 0.0]])
    assert explained_variance(worse, returns, mask) == pytest.approx(1 - 3 / (1 + 1e-5))
    assert explained_variance(returns, returns, torch.tensor([[1.0, 0, 0, 0]])) == 0.0
