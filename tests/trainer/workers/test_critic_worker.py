"""The critic worker on the tiny model: a fresh value head drawn from the seed (the same in
every process, the run's random stream untouched), micro-batches that add up to one pass's
gradient, and a checkpoint that round-trips (and a clear error for one without a critic)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.models import resolve_model_path
from tests.trainer.helpers import random_batch
from trainer.errors import CheckpointError
from trainer.workers.critic import CRITIC_FILES, CriticWorker


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(None)


def batch_with_targets(model_dir: Path, rows: int = 5):
    batch = random_batch(model_dir, rows, seed=1)
    g = torch.Generator().manual_seed(2)
    batch.values = torch.randn(batch.loss_mask.shape, generator=g) * 0.1
    batch.returns = torch.randn(batch.loss_mask.shape, generator=g) * batch.loss_mask
    return batch


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


def test_the_fresh_head_comes_from_the_seed_and_leaves_the_random_stream_alone(model_dir):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = CriticWorker(model_dir, lr=1e-3, seed=5)
    assert torch.equal(torch.random.get_rng_state(), before)
    b = CriticWorker(model_dir, lr=1e-3, seed=5)
    c = CriticWorker(model_dir, lr=1e-3, seed=6)
    head = {n: p for n, p in a.model.named_parameters() if n.startswith("score")}
    assert head, "a value head named score"
    assert all(torch.equal(p, dict(b.model.named_parameters())[n]) for n, p in head.items())
    assert not torch.equal(head["score.weight"], dict(c.model.named_parameters())["score.weight"])
    batch = batch_with_targets(model_dir)
    values = a.compute_values(batch)
    assert values.shape == batch.loss_mask.shape and values.dtype == torch.float32


def test_micro_batches_add_up_to_one_pass(model_dir):
    batch = batch_with_targets(model_dir)
    whole = CriticWorker(model_dir, lr=1e-3, seed=0)
    expected = whole.forward_backward(batch, batch.counts)
    micro = CriticWorker(model_dir, lr=1e-3, seed=0, micro_batch_size=2)
    got = micro.forward_backward(batch, batch.counts)
    torch.testing.assert_close(flat_grad(micro.model), flat_grad(whole.model), rtol=1e-4, atol=1e-7)
    assert got == pytest.approx(expected, rel=1e-4)
    assert expected["critic/vf_loss"] > 0
    stepped = whole.optim_step()
    assert stepped["critic/grad_norm"] > 0 and stepped["critic/lr"] == 1e-3


def test_the_checkpoint_round_trips_and_one_without_a_critic_is_refused(model_dir, tmp_path):
    batch = batch_with_targets(model_dir)
    critic = CriticWorker(model_dir, lr=1e-3, seed=0, warmup_steps=3)
    critic.forward_backward(batch)
    critic.optim_step()
    critic.save_checkpoint(tmp_path)
    assert all((tmp_path / name).exists() for name in CRITIC_FILES)
    later = batch_with_targets(model_dir, rows=3)
    saved_values = critic.compute_values(later)
    critic.forward_backward(later)
    after = critic.optim_step()

    again = CriticWorker(model_dir, lr=1e-3, seed=9, warmup_steps=3)  # another fresh head
    again.load_checkpoint(tmp_path)
    again.forward_backward(later)
    assert again.optim_step() == pytest.approx(after, rel=1e-6)
    for (name, p), q in zip(critic.model.named_parameters(), again.model.parameters()):
        assert torch.equal(p, q), name
    # a saved critic is a model directory critic.model.path accepts, head and all
    reloaded = CriticWorker(tmp_path / "critic", lr=1e-3, seed=9)
    torch.testing.assert_close(reloaded.compute_values(later), saved_values)

    with pytest.raises(CheckpointError, match="holds no critic"):
        again.load_checkpoint(tmp_path / "nothing")
