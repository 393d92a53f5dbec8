"""GRPO and RLOO advantages, the PPO-clip loss, masked reductions, KL estimators and token
log-probs against hand-computed values (the other estimators, losses and aggregation modes:
test_advantages.py, test_policy_losses.py, test_loss_aggregation.py)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.algorithms import (
    POLICY_LOSS_METRICS,
    BatchCounts,
    compute_advantages,
    kl_penalty,
    masked_mean,
    masked_sum,
    policy_loss,
    token_logprobs,
)

F64 = torch.float64
SQRT3 = math.sqrt(3.0)


def t(values, dtype=F64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


# --------------------------------------------------------------------------- GRPO


def test_grpo_normalizes_a_group_by_its_unbiased_std():
    # group [1, 2, 3]: mean 2, deviations [-1, 0, 1], sum of squares 2,
    # unbiased var 2 / (3 - 1) = 1, std 1 -> advantages [-1, 0, 1].
    adv = compute_advantages(t([1.0, 2.0, 3.0]), [0, 0, 0], eps=0.0)
    torch.testing.assert_close(adv, t([-1.0, 0.0, 1.0]))


def test_grpo_uses_unbiased_std_not_population_std():
    # group [0, 0, 1, 1]: mean 0.5, deviations ±0.5, sum of squares 4 * 0.25 = 1,
    # unbiased var 1 / 3, std 1/sqrt(3) -> advantages ±0.5 * sqrt(3) = ±0.8660254.
    # (population std would be 0.5 and give ±1.)
    adv = compute_advantages(t([0.0, 0.0, 1.0, 1.0]), [4, 4, 4, 4], eps=0.0)
    h = 0.5 * SQRT3
    torch.testing.assert_close(adv, t([-h, -h, h, h]))


def test_grpo_eps_is_added_to_the_std():
    # [1, 2, 3] with eps 1e-6: [-1, 0, 1] / (1 + 1e-6).
    adv = compute_advantages(t([1.0, 2.0, 3.0]), [0, 0, 0])
    d = 1.0 / (1.0 + 1e-6)
    torch.testing.assert_close(adv, t([-d, 0.0, d]), rtol=0, atol=1e-12)


def test_grpo_zero_variance_group_gets_exactly_zero():
    # 0.1 is not exactly representable: mean(0.1, 0.1, 0.1) in float64 is 0.10000000000000002,
    # so r - mean would be -1.4e-17, and divided by (0 + eps) -1.4e-11, not 0.
    rewards = t([0.1, 0.1, 0.1, 1.0, 2.0, 3.0])
    adv = compute_advantages(rewards, [0, 0, 0, 1, 1, 1])
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[3:].abs().sum() > 0
    adv_rloo = compute_advantages(rewards, [0, 0, 0, 1, 1, 1], "rloo")
    assert adv_rloo[:3].tolist() == [0.0, 0.0, 0.0]


def test_grpo_group_of_size_one_gets_zero():
    adv = compute_advantages(t([5.0, 1.0, 3.0]), [9, 2, 2], eps=0.0)
    # group 9 = [5] -> 0; group 2 = [1, 3]: mean 2, deviations ±1, unbiased var 2 / 1, std sqrt2.
    torch.testing.assert_close(adv, t([0.0, -1 / math.sqrt(2), 1 / math.sqrt(2)]))


def test_grpo_groups_are_found_by_id_not_position():
    # interleaved ids: group 7 = rewards [1, 2, 3] at positions 0, 2, 4 -> [-1, 0, 1];
    # group 3 = rewards [0, 0, 1] at positions 1, 3, 5: mean 1/3, deviations
    # [-1/3, -1/3, 2/3], sum of squares 1/9 + 1/9 + 4/9 = 2/3, unbiased var 1/3,
    # std 1/sqrt3 -> [-1/sqrt3, -1/sqrt3, 2/sqrt3].
    rewards = t([1.0, 0.0, 2.0, 0.0, 3.0, 1.0])
    ids = torch.tensor([7, 3, 7, 3, 7, 3])
    adv = compute_advantages(rewards, ids, eps=0.0)
    a = 1 / SQRT3
    torch.testing.assert_close(adv, t([-1.0, -a, 0.0, -a, 1.0, 2 * a]))


def test_grpo_without_std_normalization_only_centers():
    # group 3 of the previous test: [0, 0, 1] - 1/3.
    adv = compute_advantages(t([0.0, 0.0, 1.0]), [3, 3, 3], norm_by_std=False)
    torch.testing.assert_close(adv, t([-1 / 3, -1 / 3, 2 / 3]))


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # [1, 2, 3]: 1 - (2+3)/2 = -1.5, 2 - (1+3)/2 = 0, 3 - (1+2)/2 = 1.5;
    # group 5 = [4] alone -> 0; group 6 = [0, 1] (non-contiguous): 0 - 1 = -1, 1 - 0 = 1.
    rewards = t([1.0, 0.0, 2.0, 4.0, 3.0, 1.0])
    adv = compute_advantages(rewards, [0, 6, 0, 5, 0, 6], "rloo")
    torch.testing.assert_close(adv, t([-1.5, -1.0, 0.0, 0.0, 1.5, 1.0]))


def test_advantages_keep_float_dtype_and_promote_integers():
    assert compute_advantages(t([0.0, 1.0], torch.float32), [0, 0]).dtype == torch.float32
    adv = compute_advantages(torch.tensor([0, 1]), [0, 0], "rloo")
    assert adv.dtype == torch.get_default_dtype()
    assert adv.tolist() == [-1.0, 1.0]
    assert compute_advantages(t([]), []).shape == (0,)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            dict(rewards=t([1.0]), group_ids=[0], estimator="ppo"),
            "allowed: grpo, rloo, reinforce_plus_plus, ",
        ),
        (dict(rewards=t([[1.0]]), group_ids=[0]), "must be 1-D"),
        (dict(rewards=t([1.0, 2.0]), group_ids=[0]), "one id per reward"),
        (dict(rewards=t([1.0, math.nan]), group_ids=[0, 0]), r"trajectories \[1\] have nan"),
    ],
)
def test_advantages_reject_bad_input_with_a_clear_message(kwargs, match):
    with pytest.raises(ValueError, match=match):
        compute_advantages(**kwargs)


groups_strategy = st.lists(
    st.lists(st.integers(-40, 40).map(lambda k: k / 4), min_size=1, max_size=6),
    min_size=1,
    max_size=5,
)


def _flatten(groups: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    rewards = [r for g in groups for r in g]
    ids = [i for i, g in enumerate(groups) for _ in g]
    # a fixed shuffle so groups are interleaved, not contiguous
    order = sorted(range(len(rewards)), key=lambda k: (k * 7919) % (len(rewards) + 1))
    return t([rewards[k] for k in order]), torch.tensor([ids[k] for k in order])


@settings(max_examples=60, deadline=None)
@given(groups=groups_strategy)
def test_grpo_advantages_of_each_group_have_mean_zero_and_unit_unbiased_std(groups):
    rewards, ids = _flatten(groups)
    adv = compute_advantages(rewards, ids, eps=0.0)
    for g in ids.unique():
        a = adv[ids == g]
        if rewards[ids == g].unique().numel() == 1:
            assert a.tolist() == [0.0] * a.numel()
        else:
            assert abs(float(a.mean())) < 1e-9
            assert abs(float(a.std()) - 1.0) < 1e-9


@settings(max_examples=60, deadline=None)
@given(groups=groups_strategy, shift=st.integers(-100, 100), scale=st.integers(1, 20))
def test_grpo_is_invariant_to_shifting_and_scaling_a_groups_rewards(groups, shift, scale):
    rewards, ids = _flatten(groups)
    base = compute_advantages(rewards, ids, eps=0.0)
    moved = torch.where(ids == 0, rewards * scale + shift, rewards)
    torch.testing.assert_close(compute_advantages(moved, ids, eps=0.0), base)
    # RLOO is shift-invariant too (not scale-invariant)
    base_rloo = compute_advantages(rewards, ids, "rloo")
    shifted = torch.where(ids == 0, rewards + shift, rewards)
    torch.testing.assert_close(compute_advantages(shifted, ids, "rloo"), base_rloo)


# --------------------------------------------------------------------------- PPO-clip


def _one_token_loss(ratio: float, adv: float) -> tuple[float, float, dict[str, float]]:
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = policy_loss(logp, t([[0.0]]), t([adv]), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    assert logp.grad is not None
    return loss.item(), float(logp.grad), metrics


def test_ppo_unclipped_token_gives_minus_ratio_times_advantage():
    # ratio 1.1 in [0.8, 1.2]: loss = -1.1 * 1 = -1.1; d/dlogp (-A * exp(logp - old)) = -1.1.
    loss, grad, m = _one_token_loss(1.1, 1.0)
    assert loss == pytest.approx(-1.1)
    assert grad == pytest.approx(-1.1)
    assert m["clip_frac"] == 0.0
    assert m["ratio_mean"] == pytest.approx(1.1)


def test_ppo_clips_high_for_positive_advantage():
    # A = 2, ratio 1.5 > 1.2: unclipped -3.0, clipped -2 * 1.2 = -2.4; max(-3.0, -2.4) = -2.4,
    # constant in logp -> zero gradient.
    loss, grad, m = _one_token_loss(1.5, 2.0)
    assert loss == pytest.approx(-2.4)
    assert grad == 0.0
    assert m["clip_frac"] == 1.0 and m["clip_frac_high"] == 1.0 and m["clip_frac_low"] == 0.0


def test_ppo_clips_low_for_negative_advantage():
    # A = -1, ratio 0.5 < 0.8: unclipped 0.5, clipped 1 * 0.8 = 0.8; max = 0.8, zero gradient.
    loss, grad, m = _one_token_loss(0.5, -1.0)
    assert loss == pytest.approx(0.8)
    assert grad == 0.0
    assert m["clip_frac"] == 1.0 and m["clip_frac_low"] == 1.0


def test_ppo_does_not_clip_the_pessimistic_side():
    # A = 1, ratio 0.5: unclipped -0.5, clipped -0.8; max = -0.5 (unclipped), gradient -0.5.
    loss, grad, m = _one_token_loss(0.5, 1.0)
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx(-0.5)
    assert m["clip_frac"] == 0.0
    # asymmetric clip range ("clip-higher"): ratio 1.25 with clip_high 0.28 is unclipped
    logp = t([[math.log(1.25)]])
    loss2, _ = policy_loss(logp, t([[0.0]]), t([1.0]), torch.ones(1, 1), clip_high=0.28)
    assert loss2.item() == pytest.approx(-1.25)


def _mixed_batch():
    # row 0 (A = +1): ratios 1.1 (unclipped), 1.5 (clipped high), 0.5 (pessimistic, unclipped)
    # row 1 (A = -1): ratios 0.5 (clipped low), 1.1 (unclipped), then one padding token
    ratios = [[1.1, 1.5, 0.5], [0.5, 1.1, 3.0]]
    logp = t([[math.log(r) for r in row] for row in ratios]).requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old, t([1.0, -1.0]), mask


def test_ppo_token_mean_over_a_mixed_batch():
    logp, old, adv, mask = _mixed_batch()
    loss, m = policy_loss(logp, old, adv, mask)
    # per-token: -1.1, -1.2, -0.5 | 0.8, 1.1 ; sum -0.9 over 5 valid tokens = -0.18
    assert loss.item() == pytest.approx(-0.18)
    assert m["pg_loss"] == pytest.approx(-0.18)
    assert m["num_tokens"] == 5.0
    # clipped: (0, 1) high and (1, 0) low -> 2 / 5
    assert m["clip_frac"] == pytest.approx(0.4)
    assert m["clip_frac_high"] == pytest.approx(0.2)
    assert m["clip_frac_low"] == pytest.approx(0.2)
    # approx_kl = mean(old - new) = -(2 ln1.1 + ln1.5 + 2 ln0.5) / 5 = 0.1580418
    assert m["approx_kl"] == pytest.approx(0.1580418, abs=1e-7)
    # ratios (1.1 + 1.5 + 0.5 + 0.5 + 1.1) / 5 = 0.94
    assert m["ratio_mean"] == pytest.approx(0.94)
    assert m["ratio_max"] == pytest.approx(1.5)
    assert m["ratio_min"] == pytest.approx(0.5)
    assert set(m) == set(POLICY_LOSS_METRICS["ppo"])
    assert all(type(v) is float for v in m.values())
    loss.backward()
    # grad = -A * ratio / 5 where unclipped, 0 where clipped or padded
    expected = t([[-1.1 / 5, 0.0, -0.5 / 5], [0.0, 1.1 / 5, 0.0]])
    torch.testing.assert_close(logp.grad, expected)


def test_ppo_accepts_per_token_advantages():
    logp, old, adv, mask = _mixed_batch()
    per_traj, _ = policy_loss(logp, old, adv, mask)
    per_token, _ = policy_loss(logp, old, adv[:, None].expand(2, 3), mask)
    assert per_token.item() == per_traj.item()


def test_masked_tokens_contribute_nothing_whatever_their_values():
    logp, old, adv, mask = _mixed_batch()
    loss_a, m_a = policy_loss(logp, old, adv, mask)
    loss_a.backward()
    grad_a = logp.grad.clone()

    garbage = logp.detach().clone()
    garbage[1, 2] = math.inf
    old_garbage = old.clone()
    old_garbage[1, 2] = math.nan
    logp_b = garbage.requires_grad_()
    adv_tok = adv[:, None].expand(2, 3).clone()
    adv_tok[1, 2] = math.inf
    loss_b, m_b = policy_loss(logp_b, old_garbage, adv_tok, mask)
    loss_b.backward()
    assert loss_b.item() == loss_a.item()
    assert m_b == m_a
    assert torch.equal(logp_b.grad, grad_a)
    assert logp_b.grad[1, 2] == 0.0


def test_micro_batches_with_the_global_token_count_reproduce_the_full_batch():
    gen = torch.Generator().manual_seed(0)
    logp_full = (torch.randn(4, 6, generator=gen, dtype=F64) * 0.3 - 1).requires_grad_()
    old = logp_full.detach() + torch.randn(4, 6, generator=gen, dtype=F64) * 0.3
    adv = torch.randn(4, generator=gen, dtype=F64)
    lengths = torch.tensor([6, 1, 4, 2])
    mask = torch.arange(6)[None, :] < lengths[:, None]
    full, _ = policy_loss(logp_full, old, adv, mask)
    full.backward()

    logp_micro = logp_full.detach().clone().requires_grad_()
    counts = BatchCounts.of(mask)  # 13 valid tokens: the whole batch's
    assert counts == BatchCounts(tokens=13, sequences=4)
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        part, _ = policy_loss(logp_micro[rows], old[rows], adv[rows], mask[rows], counts=counts)
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach())
    assert torch.equal(logp_micro.grad, logp_full.grad)

    # averaging per-micro-batch token means instead weighs the 1-token row's token 13/3x
    # as much as it should: not equivalent
    per_micro = sum(
        policy_loss(logp_full[r], old[r], adv[r], mask[r])[0].item()
        for r in (slice(0, 1), slice(1, 3), slice(3, 4))
    )
    assert per_micro / 3 != pytest.approx(full.item())


def test_ppo_with_no_valid_token_is_zero_not_nan():
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, m = policy_loss(logp, logp.detach(), t([1.0, 2.0]), torch.zeros(2, 3))
    assert loss.item() == 0.0 and all(v == 0.0 for v in m.values())
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 3, dtype=F64))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(advantages=t([1.0, 2.0, 3.0])), r"advantages must be \[B\] or \[B, T\]"),
        (dict(mask=torch.ones(2, 2)), "one shape"),
        (dict(clip_low=1.5), r"clip_low must be in \[0, 1\]"),
        (dict(clip_high=-0.1), "clip_high must be >= 0"),
        (dict(clip_ratio_c=1.0), r"clip_ratio_c \(dual-clip\) must be > 1"),
        (dict(loss="gspo"), "'gspo' is one term per sequence"),
        (dict(loss="a2c"), "allowed: ppo, gspo, cispo"),
        (dict(loss_agg_mode="sum"), "allowed: token-mean, seq-mean-token-sum"),
    ],
)
def test_policy_loss_rejects_bad_input(kwargs, match):
    args = dict(
        logprobs=torch.zeros(2, 3), old_logprobs=torch.zeros(2, 3), advantages=t([1.0, 2.0])
    )
    args["mask"] = torch.ones(2, 3)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(**args)


# --------------------------------------------------------------------------- reductions, KL


def test_masked_sum_and_mean():
    x = t([[1.0, 2.0, math.nan], [4.0, math.inf, 6.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert float(masked_sum(x, mask)) == 13.0  # 1 + 2 + 4 + 6
    assert float(masked_mean(x, mask)) == 3.25  # 13 / 4
    torch.testing.assert_close(masked_mean(x, mask, dim=1), t([1.5, 5.0]))
    # a row with nothing valid averages to 0, not nan
    empty = torch.tensor([[True, False, False], [False, False, False]])
    torch.testing.assert_close(masked_mean(x, empty, dim=-1), t([1.0, 0.0]))
    with pytest.raises(ValueError, match=r"does not match"):
        masked_sum(x, torch.ones(3, 2))


def test_kl_estimators_on_hand_computed_values():
    # token 0: p = 0.5, ref = 0.25 -> d = ln2 = 0.6931472
    #   k1 = 0.6931472; k2 = d^2 / 2 = 0.2402265; k3 = e^{-d} + d - 1 = 0.5 + 0.6931472 - 1
    #   = 0.1931472; abs = 0.6931472
    # token 1: p = 0.25, ref = 0.5 -> d = -ln2
    #   k1 = -0.6931472; k3 = e^{ln2} - ln2 - 1 = 2 - 0.6931472 - 1 = 0.3068528
    logp = t([math.log(0.5), math.log(0.25)])
    ref = t([math.log(0.25), math.log(0.5)])
    ln2 = math.log(2)
    torch.testing.assert_close(kl_penalty(logp, ref, "k1"), t([ln2, -ln2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k2"), t([ln2**2 / 2, ln2**2 / 2]))
    torch.testing.assert_close(kl_penalty(logp, ref, "k3"), t([0.1931472, 0.3068528]))
    torch.testing.assert_close(kl_penalty(logp, ref), kl_penalty(logp, ref, "k3"))
    torch.testing.assert_close(kl_penalty(logp, ref, "abs"), t([ln2, ln2]))
    # identical distributions: every estimator is 0
    assert kl_penalty(logp, logp, "k3").tolist() == [0.0, 0.0]


def test_k3_is_clamped_for_stability():
    # ref - logp = 50: exp(50) would be 5e21; clamped to 10
    out = kl_penalty(t([-60.0]), t([-10.0]), "k3")
    assert out.tolist() == [10.0]
    with pytest.raises(ValueError, match=r"allowed: k1, k2, k3, abs"):
        kl_penalty(t([0.0]), t([0.0]), "k4")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- token logprobs


def test_token_logprobs_hand_computed_and_with_temperature():
    # logits [0, ln3] -> probs [1/4, 3/4]; token 1 -> ln(3/4), token 0 -> ln(1/4)
    logits = t([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    ids = torch.tensor([[1, 0]])
    torch.testing.assert_close(token_logprobs(logits, ids), t([[math.log(0.75), math.log(0.25)]]))
    # temperature 2: logits [0, ln3 / 2] = [0, ln sqrt3]; token 0 -> -ln(1 + sqrt3)
    out = token_logprobs(logits, ids, temperature=2.0)
    torch.testing.assert_close(out[0, 1], torch.tensor(-math.log(1 + SQRT3), dtype=F64))


def test_token_logprobs_matches_log_softmax_in_every_precision():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=gen)
    ids = torch.randint(0, 11, (3, 5), generator=gen)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, ids[..., None]).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, ids, 0.7), ref)
    half = token_logprobs(logits.bfloat16(), ids, 0.7)
    assert half.dtype == torch.float32
    torch.testing.assert_close(half, ref, atol=0.05, rtol=0.05)
    with pytest.raises(ValueError, match=r"temperature must be > 0"):
        token_logprobs(logits, ids, 0.0)
    with pytest.raises(ValueError, match=r"plus a vocabulary dimension"):
        token_logprobs(logits, ids[:, :2])
