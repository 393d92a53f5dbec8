"""The sampled tokens' logprobs fused with the LM head, in chunks of trained positions: the
same numbers and the same gradients as the full ``[B, L, V]`` logits' computation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import trainer.algorithms._logprobs as chunking
from engines.models import build_tiny_model
from trainer import algorithms
from trainer.workers.batch import TrainBatch
from trainer.workers.logprobs import forward_logprobs, fused_head
from trainer.workers.policy import PolicyWorker, RefWorker


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model()


def padded_multi_turn_batch(model_dir: Path, seed: int = 0) -> TrainBatch:
    """Right-padded rows of different lengths; row 1 has two trained turns with an
    environment's tokens between them, row 3 no trained token."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    lengths = [12, 10, 7, 9, 5, 12]
    ids = torch.randint(0, vocab, (len(lengths), 12), generator=g)
    attn = (torch.arange(12)[None, :] < torch.tensor(lengths)[:, None]).long()
    mask = torch.zeros(len(lengths), 11)
    for row, spans in enumerate([[(3, 11)], [(2, 4), (6, 9)], [(4, 6)], [], [(1, 4)], [(5, 11)]]):
        for start, end in spans:
            mask[row, start:end] = 1.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        advantages=torch.randn(len(lengths), generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(len(lengths), 11, generator=g),
        ref_logprobs=-3.0 + 0.1 * torch.randn(len(lengths), 11, generator=g),
    )


def full_logprobs(model: torch.nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """The computation through the wrapper's full logits, as before the head was fused."""
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    lp = algorithms.token_logprobs(logits[:, :-1, :], batch.input_ids[:, 1:], temperature)
    return torch.where(batch.loss_mask != 0, lp.float(), torch.zeros(()))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_equal_the_full_computation_on_the_tiny_model(
    model_dir, monkeypatch, temperature
):
    monkeypatch.setattr(chunking, "LOGPROB_CHUNK_ELEMENTS", 3 * 56)  # 3 positions per chunk
    model = PolicyWorker(model_dir, lr=1e-3).model
    assert fused_head(model) is not None  # the built-in model is recognised
    batch = padded_multi_turn_batch(model_dir)
    with torch.no_grad():
        got = forward_logprobs(model, batch, temperature)
        want = full_logprobs(model, batch, temperature)
    assert got.dtype == torch.float32 and got.shape == batch.loss_mask.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert (got[batch.loss_mask == 0] == 0).all()
    assert (got[batch.loss_mask != 0] < 0).all()


def test_the_chunked_path_has_the_gradient_of_the_full_path(model_dir, monkeypatch):
    monkeypatch.setattr(chunking, "LOGPROB_CHUNK_ELEMENTS", 4 * 56)
    batch = padded_multi_turn_batch(model_dir, seed=1)
    weights = torch.randn(batch.loss_mask.shape, generator=torch.Generator().manual_seed(2))
    grads = []
    for compute in (forward_logprobs, full_logprobs):
        model = PolicyWorker(model_dir, lr=1e-3, seed=0).model
        (compute(model, batch, 0.8) * weights).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))  # type: ignore[union-attr]
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


def test_a_micro_batch_without_a_trained_token_still_runs_its_backward(model_dir):
    model = PolicyWorker(model_dir, lr=1e-3).model
    batch = padded_multi_turn_batch(model_dir).select([3])  # no trained token
    logprobs = forward_logprobs(model, batch, 1.0)
    assert logprobs.requires_grad and (logprobs == 0).all()
    logprobs.sum().backward()


def test_a_model_with_a_logit_transform_or_without_a_head_takes_the_full_logits(model_dir):
    worker = RefWorker(model_dir)
    batch = padded_multi_turn_batch(model_dir)
    fused = worker.compute_logprobs(batch)
    config: Any = worker.model.config
    config.final_logit_softcapping = 30.0  # Gemma 2's (Qwen2 ignores it: the same numbers)
    assert fused_head(worker.model) is None
    torch.testing.assert_close(worker.compute_logprobs(batch), fused, rtol=0, atol=1e-6)

    class Wrapped(torch.nn.Module):  # no .model body, no lm_head
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **kwargs):
            return self.inner(**kwargs)

    assert fused_head(Wrapped(worker.model)) is None
    with torch.no_grad():
        got = forward_logprobs(Wrapped(worker.model), batch, 1.0)
    torch.testing.assert_close(got, fused, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_token_logprobs_on_random_inputs_equal_the_full_logits(dtype):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(300, 16, generator=g) * 0.5).to(dtype).requires_grad_()
    bias = torch.randn(300, generator=g).to(dtype).requires_grad_()
    ids = torch.randint(0, 300, (37,), generator=g)
    got = algorithms.head_token_logprobs(hidden, weight, ids, 0.6, head_bias=bias, chunk_rows=5)
    logits = torch.nn.functional.linear(hidden, weight, bias)
    want = algorithms.token_logprobs(logits, ids, 0.6).float()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    cotangent = torch.randn(37, generator=g)
    got_grads = torch.autograd.grad((got * cotangent).sum(), (hidden, weight, bias))
    want_grads = torch.autograd.grad((want * cotangent).sum(), (hidden, weight, bias))
    for a, b in zip(got_grads, want_grads):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        else:  # bfloat16 gradients, summed over the chunks in another order
            assert float((a - b).float().norm() / b.float().norm()) < 1e-2
    with pytest.raises(ValueError, match="must be"):
        algorithms.head_token_logprobs(hidden, weight, ids[:3])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        algorithms.head_token_logprobs(hidden, weight, ids, 0.0)
