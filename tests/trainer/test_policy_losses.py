"""The policy losses beyond plain PPO-clip (dual-clip, GSPO, CISPO) against values and
gradients worked out by hand, and their registry."""

from __future__ import annotations

import inspect
import math
import typing

import pytest
import torch

from trainer.algorithms import POLICY_LOSS_METRICS, POLICY_LOSSES, BatchCounts, policy_loss
from trainer.config import load_config
from trainer.config._schema import AlgorithmConfig
from trainer.errors import ConfigError

F64 = torch.float64
SEQ = "seq-mean-token-mean"


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def one_token(ratio: float, adv: float, **kwargs) -> tuple[float, float, dict[str, float]]:
    logp = t([[math.log(ratio)]]).requires_grad_()
    loss, metrics = policy_loss(logp, t([[0.0]]), t([adv]), torch.ones(1, 1), **kwargs)
    loss.backward()
    assert logp.grad is not None
    return loss.item(), float(logp.grad), metrics


def test_dual_clip_bounds_a_negative_advantage_token_with_a_huge_ratio():
    # A = -1, ratio 5: PPO's max(5, 1.2) = 5 with gradient 5 (d/dlogp of -A exp(logp));
    # dual-clip c = 3 caps it at -A c = 3, a constant: no gradient.
    loss, grad, m = one_token(5.0, -1.0)
    assert (loss, grad) == (pytest.approx(5.0), pytest.approx(5.0))
    loss, grad, m = one_token(5.0, -1.0, clip_ratio_c=3.0)
    assert (loss, grad, m["dual_clip_frac"]) == (pytest.approx(3.0), 0.0, 1.0)
    # below c it is plain PPO: ratio 2 -> max(2, 1.2) = 2, gradient 2
    loss, grad, m = one_token(2.0, -1.0, clip_ratio_c=3.0)
    assert (loss, grad, m["dual_clip_frac"]) == (pytest.approx(2.0), pytest.approx(2.0), 0.0)
    # a positive advantage is never dual-clipped: ratio 5, A = 1 -> max(-5, -1.2) = -1.2
    loss, grad, m = one_token(5.0, 1.0, clip_ratio_c=3.0)
    assert (loss, grad, m["dual_clip_frac"]) == (pytest.approx(-1.2), 0.0, 0.0)
    assert set(m) == set(POLICY_LOSS_METRICS["ppo"])


def _two_sequences():
    # row 0: token log-ratios ln 1.1, ln 1.1 -> sequence ratio 1.1; row 1: ln 2, 0 -> its
    # geometric mean sqrt(2) = 1.414; both A = +1
    log_ratio = t([[math.log(1.1), math.log(1.1)], [math.log(2.0), 0.0]])
    old = torch.full((2, 2), -1.0, dtype=F64)
    logp = (old + log_ratio).requires_grad_()
    return logp, old, t([1.0, 1.0]), torch.ones(2, 2)


def test_gspo_clips_the_length_normalized_ratio_of_each_sequence():
    logp, old, adv, mask = _two_sequences()
    loss, m = policy_loss(logp, old, adv, mask, loss="gspo", loss_agg_mode="seq-mean-token-mean")
    # row 0: s = 1.1 inside [0.8, 1.2]: -1.1 per token; row 1: s = 1.414 > 1.2: -1.2, clipped.
    # seq-mean-token-mean: (-1.1 + -1.2) / 2 = -1.15
    assert loss.item() == pytest.approx(-1.15)
    loss.backward()
    # row 0: d/dlogp_t of -s_t with s_t = sg[s] exp(logp_t - sg[logp_t]) is -s = -1.1, over 2
    # tokens and 2 sequences: -0.275 each; row 1 is clipped: 0.
    torch.testing.assert_close(logp.grad, t([[-0.275, -0.275], [0.0, 0.0]]))
    assert m["clip_frac"] == 0.5
    assert m["seq_ratio_mean"] == pytest.approx((1.1 + math.sqrt(2)) / 2)
    assert (m["seq_ratio_max"], m["seq_ratio_min"]) == (pytest.approx(math.sqrt(2)), 1.1)
    # token-level PPO would clip only row 1's first token (ratio 2) and train its second
    ppo, _ = policy_loss(logp.detach(), old, adv, mask)
    assert ppo.item() == pytest.approx((-1.1 - 1.1 - 1.2 - 1.0) / 4)
    assert set(m) == set(POLICY_LOSS_METRICS["gspo"])


def test_gspo_averages_the_raw_token_log_ratios_and_clamps_only_the_sequences():
    # One sequence, token log-ratios [25, 0, 0, 0, 0], A = -1: the paper's (and verl's) mean
    # log-ratio is 25 / 5 = 5, s = e^5 = 148.41; -A s = 148.41 beats -A clip(s) = 1.2 on every
    # token and seq-mean-token-mean gives 148.41. Clamping the token first (25 -> 20) would
    # give e^4 = 54.60.
    old = torch.zeros(1, 5, dtype=F64)
    logp = t([[25.0, 0.0, 0.0, 0.0, 0.0]]).requires_grad_()
    loss, m = policy_loss(logp, old, t([-1.0]), torch.ones(1, 5), loss="gspo", loss_agg_mode=SEQ)
    assert loss.item() == pytest.approx(math.exp(5))
    assert m["seq_ratio_max"] == pytest.approx(math.exp(5))
    # the sequence's log-ratio alone is clamped, to 20: a mean of 30 counts as 20
    loss, _ = policy_loss(
        t([[150.0, 0, 0, 0, 0]]), old, t([-1.0]), torch.ones(1, 5), loss="gspo", loss_agg_mode=SEQ
    )
    assert loss.item() == pytest.approx(math.exp(20))


def test_cispo_keeps_every_tokens_gradient_and_only_bounds_its_weight():
    # ratios 1.5 (A = 1), 1.1 (A = 1), 0.5 (A = -1) with old = -1; weights sg[clip(r)]:
    # 1.2, 1.1, 0.8. loss_t = -w A logp_t; token-mean over 3.
    old = t([[-1.0, -1.0, -1.0]])
    logp = (old + t([[math.log(1.5), math.log(1.1), math.log(0.5)]])).requires_grad_()
    adv = t([[1.0, 1.0, -1.0]])
    loss, m = policy_loss(logp, old, adv, torch.ones(1, 3), loss="cispo")
    lp = logp.detach()[0].tolist()
    assert loss.item() == pytest.approx((-1.2 * lp[0] - 1.1 * lp[1] + 0.8 * lp[2]) / 3)
    loss.backward()
    # the clipped tokens still learn (PPO would give 0 to tokens 0 and 2)
    torch.testing.assert_close(logp.grad, t([[-1.2 / 3, -1.1 / 3, 0.8 / 3]]))
    assert (m["clip_frac"], m["clip_frac_high"], m["clip_frac_low"]) == pytest.approx(
        (2 / 3, 1 / 3, 1 / 3)
    )
    assert set(m) == set(POLICY_LOSS_METRICS["cispo"])


@pytest.mark.parametrize("loss_name", ["ppo", "gspo", "cispo"])
def test_truncated_importance_weights_compose_with_every_loss(loss_name):
    logp, old, adv, mask = _two_sequences()
    agg = "seq-mean-token-mean" if loss_name == "gspo" else "token-mean"
    kwargs = dict(loss=loss_name, loss_agg_mode=agg, clip_ratio_c=3.0)
    plain, _ = policy_loss(logp, old, adv, mask, **kwargs)
    (g_plain,) = torch.autograd.grad(plain, logp)
    weights = t([[0.5, 2.0], [1.0, 0.25]])
    weighted, _ = policy_loss(logp, old, adv, mask, token_weights=weights, **kwargs)
    (g_weighted,) = torch.autograd.grad(weighted, logp)
    # each token's term (and gradient) is multiplied by its weight
    torch.testing.assert_close(g_weighted, g_plain * weights)


def test_every_loss_is_a_documented_function_and_the_configs_allowed_values():
    for name in POLICY_LOSSES.names:
        fn = POLICY_LOSSES.get(name)
        assert inspect.isfunction(fn) and fn.__doc__, name
        assert "verl" in fn.__doc__ or "Tinker" in fn.__doc__, name  # the peer it follows
        assert name in POLICY_LOSS_METRICS
    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["policy_loss"]) == POLICY_LOSSES.names
    with pytest.raises(ConfigError, match=r"policy_loss='grpo' is not allowed: choose one of"):
        load_config(None, ["algorithm.policy_loss=grpo"])
    with pytest.raises(ConfigError, match=r"'gspo' is defined with loss_agg_mode='seq-mean-tok"):
        load_config(None, ["algorithm.policy_loss=gspo", "algorithm.loss_agg_mode=token-mean"])
    with pytest.raises(ConfigError, match=r"clip_ratio_c=1.0 .*must be > 1"):
        load_config(None, ["algorithm.clip_ratio_c=1.0"])
    cfg = load_config(None, ["algorithm.policy_loss=gspo"])
    assert cfg.algorithm.loss_agg_mode is None  # resolved per loss: see test_loss_aggregation


def test_no_trained_token_is_zero_for_every_loss():
    for name, agg in (("ppo", "token-mean"), ("gspo", "seq-mean-token-mean"), ("cispo", None)):
        logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
        kwargs = {"loss_agg_mode": agg} if agg else {}
        loss, m = policy_loss(
            logp, logp.detach(), t([1.0, 2.0]), torch.zeros(2, 3), loss=name, **kwargs
        )
        assert loss.item() == 0.0 and set(m.values()) == {0.0}, name
        loss.backward()
        assert torch.equal(logp.grad, torch.zeros(2, 3, dtype=F64)), name
    assert BatchCounts.of(torch.zeros(2, 3)) == BatchCounts(0, 0)
