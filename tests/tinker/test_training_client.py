"""The official SDK trains a LoRA adapter on the tiny model through ``python -m trainer serve``:
its numbers are checked against the same model computed here, in torch."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.tinker.conftest import KEY, Service

TOKENS = [3, 17, 5, 22, 9, 41, 12, 30]  # as sdk_client.py
WEIGHTS = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


@pytest.fixture(scope="module")
def trained(service: Service) -> dict:
    return service.sdk("train")


def base_logprobs() -> torch.Tensor:
    """The tiny base model's logprob of each target of sdk_client's datum, computed directly:
    a fresh adapter's B is zero, so the untrained LoRA model is the base model."""
    from transformers import AutoModelForCausalLM

    from engines.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([TOKENS[:-1]])).logits[0]
    return torch.log_softmax(logits.double(), -1)[torch.arange(7), torch.tensor(TOKENS[1:])]


def test_cross_entropy_equals_the_weighted_nll_of_the_base_model(trained: dict) -> None:
    expected = base_logprobs()
    got = torch.tensor(trained["before"]["logprobs"][0], dtype=torch.float64)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    nll = -(expected * torch.tensor(WEIGHTS, dtype=torch.float64)).sum()
    assert trained["before"]["loss"] == pytest.approx(float(nll), abs=1e-4)
    # the first forward_backward sees the same weights as the forward before it
    assert trained["train_losses"][0] == pytest.approx(trained["before"]["loss"], abs=1e-5)


def test_optim_step_lowers_the_supervised_loss(trained: dict) -> None:
    assert trained["lora_rank"] == 4
    assert trained["after"]["loss"] < trained["before"]["loss"] - 0.5
    assert trained["after"]["logprobs"] != trained["before"]["logprobs"]


def test_importance_sampling_equals_its_definition(trained: dict) -> None:
    out = trained["importance_sampling"]
    # forward only, after the last optim_step: the same logprobs as the forward before it
    assert out["logprobs"] == trained["after"]["logprobs"]
    p = torch.tensor(out["logprobs"][0], dtype=torch.float64)
    q = torch.tensor(out["sampling"], dtype=torch.float64)
    adv = torch.tensor(out["advantages"], dtype=torch.float64)
    assert out["loss"] == pytest.approx(float(-(torch.exp(p - q) * adv).sum()), rel=1e-5)


def test_a_loss_not_served_is_refused_in_the_sdks_error_shape(trained: dict) -> None:
    refused = trained["refused"]
    assert refused["type"] == "RequestFailedError"
    assert refused["category"] == "user"
    assert (
        "loss_fn 'stable_reinforce' is not served (the Tinker docs this service follows do not "
        "define it); served: cross_entropy, importance_sampling, ppo, cispo, dro, gspo"
    ) in refused["message"]


def test_a_wrong_key_is_refused_with_401(service: Service) -> None:
    answer = service.sdk("wrong_key", key="tml-not-the-key")
    assert answer["status"] == 401
    assert answer["body"]["category"] == "user"
    assert "X-API-Key" in answer["body"]["error"]


def test_a_route_not_served_says_so(service: Service) -> None:
    r = httpx.post(f"{service.url}/api/v1/create_custom_loss", headers={"X-API-Key": KEY}, json={})
    assert r.status_code == 404
    assert r.json() == {
        "error": "/api/v1/create_custom_loss is not served by this trainer's Tinker "
        "service yet (it serves training clients: create_model, forward, forward_backward, "
        "optim_step; sampling clients: save_weights_for_sampler, create_sampling_session, "
        "asample; see docs/tinker.md)",
        "category": "user",
    }
    assert httpx.get(f"{service.url}/api/v1/healthz").json() == {"status": "ok"}
