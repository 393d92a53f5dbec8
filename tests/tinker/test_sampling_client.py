"""The official SDK's sampling clients through ``python -m trainer serve``: a trained LoRA
adapter synced into the reference engine (the trainer's verified adapter sync), sampled, and
each sampled token's logprob checked against the trained policy's (the training client's
``forward``) and, for the base model's sampler, against the tiny model computed here."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import pytest
import torch

from tests.tinker.conftest import Service, open_service

PROMPT = [3, 17, 5, 22, 9]  # as sdk_sampling.py
#: The engine reports the sampling distribution's logprobs (temperature 1: the model's own),
#: in float32 like the policy's forward.
ATOL = 1e-4


#: The engine rounds its logits to bfloat16 (and says nothing) for requests of a model's step 5
#: alone: the probe of a sampler save after five optim_steps (sdk_sampling.py's ``mismatch``;
#: no other scenario saves there), which ``sync.verify`` must catch.
FAULTS = "generate:bf16_logits@5"


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with open_service(tmp_path_factory.mktemp("serve"), env={"TRAINER_FAULTS": FAULTS}) as running:
        yield running


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


@functools.cache
def tiny_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    from engines.models import resolve_model_path

    return AutoModelForCausalLM.from_pretrained(resolve_model_path(None), dtype=torch.float32)


def base_rows(tokens: list[int]) -> torch.Tensor:
    """The tiny base model's next-token logprobs after each of PROMPT + ``tokens``, in torch."""
    with torch.no_grad():
        logits = tiny_model()(input_ids=torch.tensor([PROMPT + tokens])).logits[0]
    return torch.log_softmax(logits.double(), -1)


def test_the_base_models_sampler_samples_the_base_model(sampled: dict) -> None:
    (base,) = sampled["base"]
    rows = base_rows(base["tokens"])
    start = len(PROMPT) - 1
    expected = [float(rows[start + i, t]) for i, t in enumerate(base["tokens"])]
    assert _max_diff([base], [expected]) <= ATOL
    # the trained policy scores the same tokens otherwise: the adapter is not the base
    assert _max_diff([base], sampled["base_policy"]) > 0.05


def test_prompt_logprobs_are_the_models_own_at_any_temperature(sampled: dict) -> None:
    got = sampled["prompt_logprobs"]  # sampled at T=0.7: the raw logits' still
    assert got[0] is None and len(got) == len(PROMPT)
    policy = sampled["prompt_policy"]
    assert max(abs(a - b) for a, b in zip(got[1:], policy)) <= ATOL
    # compute_logprobs(prompt_logprobs_last_n=2): the last two, None before them
    last_two = sampled["last_two"]
    assert last_two[:-2] == [None] * (len(PROMPT) - 2)
    assert max(abs(a - b) for a, b in zip(last_two[-2:], policy[-2:])) <= ATOL


def test_top_k_prompt_logprobs_are_the_base_models_best(sampled: dict) -> None:
    rows = base_rows([])
    plain, topk = sampled["base_prompt_logprobs"], sampled["base_topk"]
    assert plain[0] is None and topk[0] is None
    for i, tok in enumerate(PROMPT[1:]):
        row = rows[i]
        assert plain[i + 1] == pytest.approx(float(row[tok]), abs=ATOL)
        values, ids = torch.topk(row, 2)
        assert [t for t, _ in topk[i + 1]] == ids.tolist()
        assert [lp for _, lp in topk[i + 1]] == pytest.approx(values.tolist(), abs=ATOL)


def test_a_request_not_served_is_refused_saying_so(sampled: dict) -> None:
    refused = sampled["not_served"]
    assert refused["category"] == "user"
    assert "topk_sample_logprobs is not served by this service yet" in refused["message"]


def test_old_unnamed_samplers_are_unloaded_and_named_ones_kept(sampled: dict) -> None:
    assert "weights were unloaded: the service keeps the last 8 unnamed" in sampled["dropped"]
    assert sampled["by_path_later"] == sampled["by_path"]


def test_the_async_api_samples_the_trained_policy(service: Service) -> None:
    out = service.sdk("sample_async")
    seqs = out["seqs"]
    assert len(seqs) == 6  # three samples at once, two sequences each
    assert len({tuple(s["tokens"]) for s in seqs}) == 6
    assert _max_diff(seqs, out["policy"]) <= ATOL


def test_a_sampler_save_the_engine_serves_wrong_is_caught_by_sync_verify(
    service: Service,
) -> None:
    """The engine skews the probe of the save after step 5 (:data:`FAULTS`): the save fails,
    in the SDK's error shape, with the check's own error naming the probe's position."""
    failed = service.sdk("mismatch")["failed"]
    assert failed["category"] == "server"
    assert "save_weights_for_sampler: WeightSyncMismatchError" in failed["message"]
