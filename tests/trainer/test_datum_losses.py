"""The training service's losses (``DATUM_LOSSES``: the Tinker protocol's ``loss_fn``) equal
their definitions in the Tinker docs, in value and in gradient."""

from __future__ import annotations

import torch

from trainer.algorithms import DATUM_LOSSES


def test_cross_entropy_is_the_weighted_nll_summed_and_its_gradient_is_minus_the_weights() -> None:
    logprobs = torch.tensor([-1.0, -2.5, -0.5, -3.0], dtype=torch.float64, requires_grad=True)
    weights = torch.tensor([0.0, 1.0, 1.0, 0.5], dtype=torch.float64)
    loss = DATUM_LOSSES.get("cross_entropy")(logprobs, {"weights": weights})
    assert float(loss.detach()) == 2.5 + 0.5 + 1.5
    loss.backward()
    assert logprobs.grad is not None
    torch.testing.assert_close(logprobs.grad, -weights)


def test_importance_sampling_is_the_ratio_weighted_advantage_summed_with_its_gradient() -> None:
    p = torch.tensor([-1.0, -2.0, -0.3], dtype=torch.float64, requires_grad=True)
    q = torch.tensor([-1.5, -1.0, -0.3], dtype=torch.float64)
    adv = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
    loss = DATUM_LOSSES.get("importance_sampling")(p, {"logprobs": q, "advantages": adv})
    ratio = torch.exp(p.detach() - q)
    torch.testing.assert_close(loss.detach(), -(ratio * adv).sum())
    loss.backward()
    assert p.grad is not None
    torch.testing.assert_close(p.grad, -ratio * adv)  # d/dp of -exp(p - q) * A
