"""Clip-Cov and KL-Cov (Cui et al. 2025, as verl 0.9.1 defines them) against hand-worked
values: which tokens each selects, the loss and its gradient, composed with a correction."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import POLICY_LOSSES, policy_loss

# One sequence of four trained tokens: logp mean -2.25, A mean 0, so the covariances
# (A_t - 0)(logp_t + 2.25) are [2.5, 0, 0, 3.5].
LOGP = [-1.0, -2.0, -2.0, -4.0]
ADV = torch.tensor([[2.0, 0.0, 0.0, -2.0]])
MASK = torch.ones(1, 4)


def _logp() -> torch.Tensor:
    return torch.tensor([LOGP], requires_grad=True)


def test_both_are_registered():
    assert {"clip_cov", "kl_cov"} <= set(POLICY_LOSSES.names)


def test_clip_cov_detaches_the_one_candidate_in_its_window():
    logp = _logp()
    options = {"clip_cov_ratio": 0.25, "clip_cov_lb": 1.0, "clip_cov_ub": 3.0}  # 1 of 4 tokens
    loss, m = policy_loss(logp, logp.detach(), ADV, MASK, loss="clip_cov", loss_options=options)
    # r = 1: per-token -A = [-2, 0, 0, 2]; token 0 (cov 2.5 in (1, 3)) drawn, token 3 (3.5) not
    assert float(loss.detach()) == pytest.approx(2.0 / 4)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 0.0, 0.0, 0.5]]))
    assert (m["cov_clip_frac"], m["cov_candidates_frac"], m["clip_frac"]) == (0.25, 0.25, 0.0)


def test_clip_cov_leaves_the_tokens_ppo_already_clips():
    logp = _logp()
    old = logp.detach() - torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # token 0: r = e, clipped
    options = {"clip_cov_ratio": 0.25, "clip_cov_lb": 1.0, "clip_cov_ub": 3.0}
    loss, m = policy_loss(logp, old, ADV, MASK, loss="clip_cov", loss_options=options)
    # nothing drawn: PPO-clip's value (clip_high 0.2), (-2 * 1.2 + 0 + 0 + 2) / 4
    assert float(loss.detach()) == pytest.approx((-2 * 1.2 + 2) / 4)
    assert (m["cov_clip_frac"], m["clip_frac"]) == (0.0, 0.25)


def test_clip_cov_draws_its_count_at_random_among_the_candidates():
    drawn = set()
    for seed in range(20):
        torch.manual_seed(seed)
        logp = _logp()
        options = {"clip_cov_ratio": 0.25, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}  # 0 and 3
        loss, m = policy_loss(logp, logp.detach(), ADV, MASK, loss="clip_cov", loss_options=options)
        assert m["cov_candidates_frac"] == 0.5 and m["cov_clip_frac"] == 0.25  # one of two
        loss.backward()
        assert logp.grad is not None
        zero = [i for i in (0, 3) if logp.grad[0, i] == 0]
        assert len(zero) == 1
        drawn.add(zero[0])
    assert drawn == {0, 3}


def test_clip_cov_defaults_are_verls():
    logp = _logp()
    _, m = policy_loss(logp, logp.detach(), ADV, MASK, loss="clip_cov")
    # (lb, ub) = (1, 5): both 2.5 and 3.5 are candidates; 0.0002 * 4 tokens rounds down to
    # 0, and at least one is drawn
    assert m["cov_candidates_frac"] == 0.5 and m["cov_clip_frac"] == 0.25
    with pytest.raises(ValueError, match="has no option kl_cov_ratio"):
        policy_loss(
            logp, logp.detach(), ADV, MASK, loss="clip_cov", loss_options={"kl_cov_ratio": 1}
        )


def test_kl_cov_penalises_the_top_covariance_token():
    logp = _logp()
    old = logp.detach() - torch.tensor([[-0.1, 0.0, 0.0, 0.2]])  # log r = [-0.1, 0, 0, 0.2]
    options = {"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.1}
    loss, m = policy_loss(logp, old, ADV, MASK, loss="kl_cov", loss_options=options)
    # no clip; token 3 (cov 3.5, the largest) gets + 0.1 |log r|
    expected = (-2 * math.exp(-0.1) + 2 * math.exp(0.2) + 0.1 * 0.2) / 4
    assert float(loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert m["kl_cov_frac"] == 0.25
    assert m["abs_kl"] == pytest.approx(0.3 / 4)
    loss.backward()
    assert logp.grad is not None
    grad = [-2 * math.exp(-0.1) / 4, 0.0, 0.0, (2 * math.exp(0.2) + 0.1) / 4]
    torch.testing.assert_close(logp.grad, torch.tensor([grad]))


def test_each_composes_with_a_correction_weight():
    weights = torch.tensor([[1.0, 1.0, 1.0, 0.5]])
    for loss_name, options in (
        ("clip_cov", {"clip_cov_ratio": 0.25, "clip_cov_lb": 1.0, "clip_cov_ub": 3.0}),
        ("kl_cov", {"kl_cov_ratio": 0.25, "ppo_kl_coef": 0.1}),
    ):
        logp = _logp()
        plain, _ = policy_loss(logp, logp.detach(), ADV, MASK, loss=loss_name, loss_options=options)
        weighted, _ = policy_loss(
            logp,
            logp.detach(),
            ADV,
            MASK,
            loss=loss_name,
            loss_options=options,
            token_weights=weights,
        )
        # only token 3 (term 2 / 4) is weighted by 0.5
        assert float(plain.detach()) - float(weighted.detach()) == pytest.approx(0.5 * 2 / 4), (
            loss_name
        )
