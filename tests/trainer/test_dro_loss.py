"""``algorithm.policy_loss=dro``: Tinker's DRO loss, ``-(logp A - 0.5 beta (logp - old)^2)``,
against hand-worked values and gradients, aggregated by the run's mode and weighted by a
rollout correction like every loss."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms import LOSS_OPTIONS, policy_loss
from trainer.config import load_config, loss_options
from trainer.errors import ConfigError
from trainer.run._parts import policy_kwargs

F64 = torch.float64


def t(x) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def test_dro_value_and_gradient_by_hand():
    """Two sequences, beta = 0.1, A = [2, -1]; the last token of sequence 1 is padding.

    seq 0: logp [-1, -2], old [-1.5, -2]  -> d = [0.5, 0]
        l = -(-1 * 2 - 0.05 * 0.25) = 2.0125;  l = -(-2 * 2 - 0) = 4.0
        dl/dlogp = -A + beta d = -2 + 0.05 = -1.95;  -2.0
    seq 1: logp [-0.5, (pad)], old [-0.1, (pad)]  -> d = -0.4
        l = -(-0.5 * -1 - 0.05 * 0.16) = -(0.5 - 0.008) = -0.492
        dl/dlogp = 1 + 0.1 * -0.4 = 0.96
    token-sum (Tinker's loss:sum) = 2.0125 + 4 - 0.492 = 5.5205
    token-mean = 5.5205 / 3 = 1.840167; its gradient is the above / 3.
    dro_penalty = mean 0.5 d^2 = (0.125 + 0 + 0.08) / 3 = 0.068333
    """
    logp = t([[-1.0, -2.0], [-0.5, 7.0]]).requires_grad_()
    old = t([[-1.5, -2.0], [-0.1, 3.0]])
    mask = t([[1, 1], [1, 0]])
    loss, m = policy_loss(
        logp, old, t([2.0, -1.0]), mask, loss="dro", loss_agg_mode="token-sum",
        loss_options={"beta": 0.1},
    )  # fmt: skip
    assert loss.item() == pytest.approx(5.5205, abs=1e-12)
    assert m["dro_penalty"] == pytest.approx(0.068333333, abs=1e-8)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[-1.95, -2.0], [0.96, 0.0]]), rtol=0, atol=1e-12)
    logp.grad = None
    mean, _ = policy_loss(logp, old, t([2.0, -1.0]), mask, loss="dro", loss_options={"beta": 0.1})
    assert mean.item() == pytest.approx(5.5205 / 3, abs=1e-12)
    mean.backward()
    torch.testing.assert_close(logp.grad, t([[-0.65, -2 / 3], [0.32, 0.0]]), rtol=0, atol=1e-12)


def test_dro_at_the_old_policy_is_reinforce_and_its_default_beta_is_tinkers_example():
    """logp = old: the penalty and its gradient vanish, l = -A logp, dl/dlogp = -A."""
    logp = t([[-0.7, -1.2]]).requires_grad_()
    loss, m = policy_loss(logp, logp.detach(), t([3.0]), t([[1, 1]]), loss="dro")
    assert loss.item() == pytest.approx(-(-0.7 * 3 - 1.2 * 3) / 2, abs=1e-12)
    loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[-1.5, -1.5]]), rtol=0, atol=1e-12)
    assert m["dro_penalty"] == 0.0
    assert LOSS_OPTIONS["dro"] == {"beta": 0.05}


def test_dro_composes_with_a_rollout_corrections_token_weights():
    """Weights [2, 0.5] multiply each token's term: 2 * 2.0125 + 0.5 * 4 = 6.025 (token-sum)."""
    logp = t([[-1.0, -2.0]]).requires_grad_()
    loss, _ = policy_loss(
        logp, t([[-1.5, -2.0]]), t([2.0]), t([[1, 1]]), loss="dro", loss_agg_mode="token-sum",
        token_weights=t([[2.0, 0.5]]), loss_options={"beta": 0.1},
    )  # fmt: skip
    assert loss.item() == pytest.approx(6.025, abs=1e-12)


def test_dros_beta_is_a_key_checked_at_load_and_reaching_the_worker():
    cfg = load_config(None, ["algorithm.policy_loss=dro", "algorithm.dro.beta=0.2"])
    assert loss_options(cfg.algorithm) == {"beta": 0.2}
    assert policy_kwargs(cfg)["loss_options"] == {"beta": 0.2}
    assert loss_options(load_config(None, ["algorithm.policy_loss=dro"]).algorithm) == {
        "beta": 0.05
    }
    with pytest.raises(ConfigError, match=r"algorithm\.dro\.beta"):
        load_config(None, ["algorithm.policy_loss=dro", "algorithm.dro.beta=0"])
    assert policy_kwargs(load_config(None, ["algorithm.dro.beta=0.2"]))["loss_options"] == {}
