"""The official SDK's sampling clients through ``python -m trainer serve``: a trained LoRA
adapter synced into the reference engine (the trainer's verified adapter sync), sampled, and
each sampled token's logprob checked against the trained policy's (the training client's
``forward``) and, for the base model's sampler, against the tiny model computed here."""

from __future__ import annotations

import pytest
import torch

from tests.tinker.conftest import Service

PROMPT = [3, 17, 5, 22, 9]  # as sdk_sampling.py
#: The engine reports the sampling distribution's logprobs (temperature 1: the model's own),
#: in float32 like the policy's forward.
ATOL = 1e-4


@pytest.fixture(scope="module")
def sampled(service: Service) -> dict:
    return service.sdk("sample")


def _max_diff(seqs: list[dict], policy: list[list[float]]) -> float:
    assert [len(s["logprobs"]) for s in seqs] == [len(p) for p in policy]
    return max(abs(a - b) for s, p in zip(seqs, policy) for a, b in zip(s["logprobs"], p))


def test_sampled_logprobs_equal_the_trained_policys(sampled: dict) -> None:
    three = sampled["three"]
    assert len(three) == 3  # num_samples
    assert len({tuple(s["tokens"]) for s in three}) == 3  # seeds seed, seed + 1, seed + 2
    assert all(1 <= len(s["tokens"]) <= 6 for s in three)  # max_tokens
    assert all(s["stop_reason"] in ("stop", "length") for s in three)
    assert _max_diff(three, sampled["three_policy"]) <= ATOL


def test_a_seed_reproduces_its_samples(sampled: dict) -> None:
    assert sampled["again"] == sampled["three"]


def test_a_stop_token_ends_the_sample_with_it(sampled: dict) -> None:
    first, stop = sampled["three"][0]["tokens"], sampled["stop_token"]
    (stopped,) = sampled["stopped"]
    assert stopped["tokens"] == first[: first.index(stop) + 1]
    assert stopped["stop_reason"] == "stop"


def test_a_named_save_samples_the_same_weights_through_its_path(sampled: dict) -> None:
    path = sampled["named_path"]
    assert path.startswith("tinker://") and path.endswith("/sampler_weights/after-3-steps")
    assert sampled["by_path"] == sampled["three"][:1]  # the same weights, the same seed


def base_logprobs(tokens: list[int]) -> list[float]:
    """The tiny base model's logprob of each of ``tokens`` after PROMPT, in torch."""
    from transformers import AutoModelForCausalLM

    from engines.models import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32)
    full = PROMPT + tokens
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([full[:-1]])).logits[0]
    logprobs = torch.log_softmax(logits.double(), -1)
    return [float(logprobs[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


def test_the_base_models_sampler_samples_the_base_model(sampled: dict) -> None:
    (base,) = sampled["base"]
    expected = base_logprobs(base["tokens"])
    assert _max_diff([base], [expected]) <= ATOL
    # the trained policy scores the same tokens otherwise: the adapter is not the base
    assert _max_diff([base], sampled["base_policy"]) > 0.05


def test_prompt_logprobs_are_refused_saying_so(sampled: dict) -> None:
    refused = sampled["prompt_logprobs_refused"]
    assert refused["category"] == "user"
    assert "prompt_logprobs is not served by this service yet" in refused["message"]


def test_the_async_api_samples_the_trained_policy(service: Service) -> None:
    out = service.sdk("sample_async")
    seqs = out["seqs"]
    assert len(seqs) == 6  # three samples at once, two sequences each
    assert len({tuple(s["tokens"]) for s in seqs}) == 6
    assert _max_diff(seqs, out["policy"]) <= ATOL
