"""The training service's losses (``DATUM_LOSSES``: the Tinker protocol's ``loss_fn``) equal
their definitions in the Tinker docs, in value and in gradient, and their ``loss_fn_config``
is checked in one sentence naming the key."""

from __future__ import annotations

import pytest
import torch

from trainer.algorithms import DATUM_LOSSES, datum_loss_config

P = [-1.0, -2.0, -0.3, -0.7, -1.2]
Q = [-1.5, -1.0, -0.3, -0.2, -2.0]
ADV = [1.0, -2.0, 0.5, 1.5, -1.0]


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    p = torch.tensor(P, dtype=torch.float64, requires_grad=True)
    return p, torch.tensor(Q, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64)


def _grad(loss: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    loss.backward()
    assert p.grad is not None
    return p.grad


def test_cross_entropy_is_the_weighted_nll_summed_and_its_gradient_is_minus_the_weights() -> None:
    logprobs = torch.tensor([-1.0, -2.5, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    loss = DATUM_LOSSES.get("cross_entropy")(logprobs, {"weights": weights})
    assert float(loss.detach()) == 2.5 + 0.5 + 1.5
    torch.testing.assert_close(_grad(loss, logprobs), -weights)


def test_importance_sampling_is_the_ratio_weighted_advantage_summed_with_its_gradient() -> None:
    p, q, adv = _inputs()
    loss = DATUM_LOSSES.get("importance_sampling")(p, {"logprobs": q, "advantages": adv})
    ratio = torch.exp(p.detach() - q)
    torch.testing.assert_close(loss.detach(), -(ratio * adv).sum())
    torch.testing.assert_close(_grad(loss, p), -ratio * adv)  # d/dp of -exp(p - q) * A


def test_ppo_clips_token_by_token_and_a_clipped_token_has_no_gradient() -> None:
    p, q, adv = _inputs()
    # ratios e^0.5=1.65 (A>0: clipped to 1.2), e^-1=0.37 (A<0: clipped to 0.8), 1, e^-0.5=0.61
    # (A>0: unclipped 0.61 < 0.8), e^0.8=2.2 (A<0: unclipped -2.2 < -1.2)
    loss = DATUM_LOSSES.get("ppo")(
        p, {"logprobs": q, "advantages": adv}, **datum_loss_config("ppo", {})
    )
    r = torch.exp(p.detach() - q)
    expected = -(
        torch.tensor([1.2 * 1.0, 0.8 * -2.0, 1.0 * 0.5, float(r[3]) * 1.5, float(r[4]) * -1.0])
    ).sum()
    torch.testing.assert_close(loss.detach(), expected.double())
    grad = _grad(loss, p)
    unclipped = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(grad, -unclipped * r * adv)


def test_ppo_takes_its_thresholds_from_loss_fn_config() -> None:
    p, q, adv = _inputs()
    config = datum_loss_config("ppo", {"clip_low_threshold": 0.5, "clip_high_threshold": 3.0})
    loss = DATUM_LOSSES.get("ppo")(p, {"logprobs": q, "advantages": adv}, **config)
    r = torch.exp(p.detach() - q)
    clipped = r.clamp(0.5, 3.0)
    torch.testing.assert_close(loss.detach(), -torch.min(r * adv, clipped * adv).sum())


def test_cispo_weights_the_logprob_by_the_detached_clipped_ratio() -> None:
    p, q, adv = _inputs()
    config = datum_loss_config("cispo", {"clip_high_threshold": 1.3})
    assert config == {"clip_low_threshold": 0.0, "clip_high_threshold": 1.3}
    loss = DATUM_LOSSES.get("cispo")(p, {"logprobs": q, "advantages": adv}, **config)
    coef = torch.exp(p.detach() - q).clamp(0.0, 1.3)
    torch.testing.assert_close(loss.detach(), -(coef * p.detach() * adv).sum())
    torch.testing.assert_close(_grad(loss, p), -coef * adv)  # every token keeps a gradient


def test_dro_is_the_advantage_weighted_logprob_minus_the_quadratic_penalty() -> None:
    p, q, adv = _inputs()
    loss = DATUM_LOSSES.get("dro")(p, {"logprobs": q, "advantages": adv}, beta=0.05)
    d = p.detach() - q
    torch.testing.assert_close(loss.detach(), -(p.detach() * adv - 0.025 * d**2).sum())
    torch.testing.assert_close(_grad(loss, p), -(adv - 0.05 * d))


def test_gspo_gives_every_token_the_sequence_ratio_and_its_own_gradient() -> None:
    p, q, adv = _inputs()
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 0.0], dtype=torch.float64)
    inputs = {"logprobs": q, "advantages": adv, "sequence_ratio_mask": mask}
    config = datum_loss_config("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1})
    loss = DATUM_LOSSES.get("gspo")(p, inputs, **config)
    s = float(torch.exp((p.detach() - q)[1:4].mean()))  # exp(-0.5/3) = 0.846: below 0.9
    per_token = torch.min(s * adv, torch.full_like(adv, min(max(s, 0.9), 1.1)) * adv)
    torch.testing.assert_close(loss.detach(), -per_token.sum())
    # d s_t / d p_t = s_t; tokens whose clipped term is the min (A<0 here: 0.9*A < s*A) get none
    unclipped = (s * adv <= 0.9 * adv).double()
    torch.testing.assert_close(_grad(loss, p), -unclipped * s * adv)


@pytest.mark.parametrize(
    ("loss_fn", "config", "message"),
    [
        ("ppo", {"beta": 1.0}, "loss_fn_config ['beta'] is not a key of ppo"),
        ("cross_entropy", {"clip_low_threshold": 0.5}, "(takes none)"),
        ("dro", {}, "dro needs loss_fn_config['beta'] (a number; no default)"),
        ("dro", {"beta": -1.0}, "must be >= 0"),
        ("cispo", {"clip_high_threshold": "x"}, "must be a finite number, not 'x'"),
        ("ppo", {"clip_low_threshold": 1.5}, "0 <= clip_low_threshold <= clip_high_threshold"),
    ],
)
def test_a_bad_loss_fn_config_is_refused_in_one_sentence(
    loss_fn: str, config: dict, message: str
) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        datum_loss_config(loss_fn, config)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)
