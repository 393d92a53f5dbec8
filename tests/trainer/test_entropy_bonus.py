"""The entropy bonus (``algorithm.entropy_coeff``, verl's ``actor.entropy_coeff``): the entropy
of the whole sampling distribution, hand-worked; the fused head's chunks and the unfused path
agree with it in value and gradient; the policy worker's loss is the policy loss less
``coeff`` times the entropy aggregated as the loss is."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import trainer.algorithms._logprobs as chunking
from engines.models import build_tiny_model
from tests.trainer.workers.test_logprobs import padded_multi_turn_batch
from trainer import algorithms
from trainer.algorithms import BatchCounts
from trainer.workers.logprobs import forward_logprobs, forward_logprobs_entropy
from trainer.workers.policy import PolicyWorker


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model()


def test_the_entropy_of_hand_worked_distributions():
    """Logits [0, ln 3]: p = [1/4, 3/4], H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.562335 nats.
    Four equal logits: ln 4 = 1.386294. At temperature 2, logits [0, 2 ln 3] are again
    [0, ln 3]: the same 0.562335. One logit far above the rest: H near 0."""
    logits = torch.tensor([[0.0, math.log(3.0)], [5.0, 5.0]])
    got = algorithms.token_entropy(logits)
    torch.testing.assert_close(got, torch.tensor([0.562335, math.log(2.0)]), rtol=0, atol=1e-6)
    assert float(algorithms.token_entropy(torch.zeros(4))) == pytest.approx(1.386294, abs=1e-6)
    tempered = algorithms.token_entropy(torch.tensor([0.0, 2 * math.log(3.0)]), 2.0)
    assert float(tempered) == pytest.approx(0.562335, abs=1e-6)
    assert float(algorithms.token_entropy(torch.tensor([50.0, 0.0, 0.0]))) < 1e-18
    with pytest.raises(ValueError, match="temperature must be > 0"):
        algorithms.token_entropy(logits, 0.0)


def test_the_entropy_gradient_is_hand_worked():
    """H(z) for two logits [a, 0] with p = sigmoid(a): dH/da = -a p (1 - p). At a = ln 3:
    p = 3/4, dH/da = -ln 3 * 3/16 = -0.205988."""
    z = torch.tensor([math.log(3.0), 0.0], requires_grad=True)
    algorithms.token_entropy(z).backward()
    assert z.grad is not None
    assert float(z.grad[0]) == pytest.approx(-math.log(3.0) * 3 / 16, abs=1e-6)
    assert float(z.grad.sum()) == pytest.approx(0.0, abs=1e-7)  # a shift changes nothing


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_fused_chunks_and_the_full_logits_give_one_entropy_and_one_gradient(
    model_dir, monkeypatch, temperature
):
    monkeypatch.setattr(chunking, "LOGPROB_CHUNK_ELEMENTS", 3 * 56)  # 3 positions a chunk
    batch = padded_multi_turn_batch(model_dir)
    got, grads = [], []
    for fused in (True, False):
        model = PolicyWorker(model_dir, lr=1e-3, seed=0).model
        if not fused:
            monkeypatch.setattr("trainer.workers.logprobs.fused_head", lambda m: None)
        logprobs, entropy = forward_logprobs_entropy(model, batch, temperature)
        (entropy.sum() + logprobs.sum()).backward()
        got.append((logprobs.detach(), entropy.detach()))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
    (lp_f, ent_f), (lp_u, ent_u) = got
    torch.testing.assert_close(lp_f, lp_u, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent_f, ent_u, rtol=0, atol=1e-5)
    assert (ent_f[batch.loss_mask == 0] == 0).all()
    trained = ent_f[batch.loss_mask != 0]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    assert (trained > 0).all() and (trained <= math.log(vocab) + 1e-5).all()
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    monkeypatch.undo()
    with torch.no_grad():  # the logprobs are forward_logprobs', to the bit
        model = PolicyWorker(model_dir, lr=1e-3, seed=0).model
        assert torch.equal(forward_logprobs(model, batch, temperature), lp_f)


def test_the_workers_loss_is_the_policy_loss_less_coeff_times_the_aggregated_entropy(model_dir):
    """seq-mean-token-mean, two micro-batches: policy/loss = pg_loss - 0.5 * entropy, where
    entropy is sum_i mean_t H_it / S over the whole mini-batch, computed here from the
    forward directly (not through the worker)."""
    batch = padded_multi_turn_batch(model_dir, seed=3)
    kwargs = {"lr": 1e-3, "seed": 0, "loss_agg_mode": "seq-mean-token-mean"}
    worker = PolicyWorker(model_dir, entropy_coeff=0.5, micro_batch_size=3, **kwargs)
    with torch.no_grad():
        _, entropy = forward_logprobs_entropy(worker.model, batch, 1.0)
    mask = batch.loss_mask != 0
    per_seq = [entropy[i][mask[i]].mean() for i in range(len(mask)) if mask[i].any()]
    want = float(sum(per_seq) / len(per_seq))
    m = worker.forward_backward(batch, BatchCounts.of(batch.loss_mask))
    assert m["policy/entropy"] == pytest.approx(want, rel=1e-5)
    assert m["policy/loss"] == pytest.approx(m["policy/pg_loss"] - 0.5 * want, rel=1e-5)
    off = PolicyWorker(model_dir, **kwargs).forward_backward(batch)
    assert "policy/entropy" not in off  # coeff 0: no entropy computed
    assert off["policy/pg_loss"] == pytest.approx(m["policy/pg_loss"], rel=1e-6)
