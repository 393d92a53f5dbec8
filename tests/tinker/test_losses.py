"""The SDK's policy losses through the service equal their Tinker definitions computed here
on the logprobs the service answered; ``forward_backward_custom`` (the SDK's forward plus a
``cross_entropy`` surrogate) trains exactly as the built-in loss of the same value."""

from __future__ import annotations

import pytest
import torch

from tests.tinker.conftest import Service


@pytest.fixture(scope="module")
def seen(service: Service) -> dict:
    return service.sdk("losses")


def _tensors(seen: dict, name: str) -> tuple[torch.Tensor, ...]:
    p = torch.tensor(seen["losses"][name]["logprobs"], dtype=torch.float64)
    q = torch.tensor(seen["sampling"], dtype=torch.float64)
    adv = torch.tensor(seen["advantages"], dtype=torch.float64)
    return p, q, adv


def test_ppo_equals_its_definition(seen: dict) -> None:
    p, q, adv = _tensors(seen, "ppo")
    r = torch.exp(p - q)  # defaults: 0.8 and 1.2
    expected = -torch.min(r * adv, r.clamp(0.8, 1.2) * adv).sum()
    assert seen["losses"]["ppo"]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_cispo_equals_its_definition_with_its_loss_fn_config(seen: dict) -> None:
    p, q, adv = _tensors(seen, "cispo")
    coef = torch.exp(p - q).clamp(0.5, 2.0)
    expected = -(coef * p * adv).sum()
    assert seen["losses"]["cispo"]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_dro_equals_its_definition_and_needs_beta(seen: dict) -> None:
    p, q, adv = _tensors(seen, "dro")
    expected = -(p * adv - 0.5 * 0.05 * (p - q) ** 2).sum()
    assert seen["losses"]["dro"]["loss"] == pytest.approx(float(expected), rel=1e-5)
    refused = seen["dro_without_beta"]
    assert refused["category"] == "user"
    assert "dro needs loss_fn_config['beta'] (a number; no default)" in refused["message"]


def test_gspo_equals_its_definition(seen: dict) -> None:
    p, q, adv = _tensors(seen, "gspo")
    mask = torch.tensor(seen["mask"]) != 0
    s = torch.exp((p - q)[mask].mean())
    expected = -torch.min(s * adv, s.clamp(0.9, 1.1) * adv).sum()
    assert seen["losses"]["gspo"]["loss"] == pytest.approx(float(expected), rel=1e-5)


def test_forward_backward_custom_trains_as_the_builtin_loss_of_the_same_value(seen: dict) -> None:
    custom = seen["custom"]
    assert custom["custom_loss"] == pytest.approx(custom["builtin_loss"], rel=1e-6)
    assert custom["custom_metric"] == pytest.approx(custom["custom_loss"], rel=1e-6)
    # the same gradient, so the same step: equal logprobs after one optim_step
    torch.testing.assert_close(
        torch.tensor(custom["custom_after"]),
        torch.tensor(custom["builtin_after"]),
        atol=1e-5,
        rtol=0,
    )
    # and the step was taken: the supervised loss fell
    weights = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0])  # sdk_client.WEIGHTS
    after = float(-(torch.tensor(custom["custom_after"][0]) * weights).sum())
    assert after < custom["custom_loss"] - 0.1
