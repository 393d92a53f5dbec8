"""A batch that gets one optimizer step takes its old logprobs from the update's own forward:
the same gradient and metrics as a separate no-grad forward first, one forward fewer."""

from __future__ import annotations

import pytest
import torch

from engines.models import build_tiny_model
from trainer.algorithms import (
    MISMATCH_SUMS,
    RolloutCorrection,
    mismatch_metrics,
    mismatch_sums,
)
from trainer.workers.batch import TrainBatch
from trainer.workers.policy import PolicyWorker


def _batch() -> TrainBatch:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 50, (4, 9), generator=gen)
    mask = torch.zeros(4, 8)
    mask[:, 4:] = 1.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=mask,
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[:, None].expand(4, 8).clone(),
        rollout_logprobs=torch.where(mask > 0, torch.full((4, 8), -3.0), torch.zeros(4, 8)),
    )


@pytest.mark.parametrize("correction", [None, "token", "sequence"])
def test_old_logprobs_from_the_updates_forward_equal_a_separate_forward(correction):
    model_dir = build_tiny_model()
    grads, metrics = [], []
    for precomputed in (True, False):
        worker = PolicyWorker(
            model_dir,
            lr=1e-3,
            micro_batch_size=3,
            rollout_correction=RolloutCorrection(rollout_is=correction),
        )
        batch = _batch()
        if precomputed:
            batch.old_logprobs = worker.compute_logprobs(batch)
        metrics.append(worker.forward_backward(batch))
        grads.append(torch.cat([p.grad.flatten() for p in worker.model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    # the update's own forward also sums the mismatch diagnostics (the loop does, recomputed)
    assert metrics[1].keys() - metrics[0].keys() == set(MISMATCH_SUMS)
    assert metrics[0].keys() <= metrics[1].keys()
    assert "policy/is_ratio_mean" in metrics[0]
    for key in metrics[0]:
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6), key


def test_the_updates_forward_sums_the_mismatch_of_the_whole_batch_over_its_micro_batches():
    """Micro-batches of 3 and 1 rows: their summed diagnostics equal the whole batch's, taken
    from one separate forward."""
    worker = PolicyWorker(build_tiny_model(), lr=1e-3, micro_batch_size=3)
    batch = _batch()
    spread = -torch.linspace(1.0, 5.0, 32).reshape(4, 8)  # varied: a correlation is defined
    batch.rollout_logprobs = torch.where(batch.loss_mask > 0, spread, torch.zeros(4, 8))
    whole = mismatch_sums(worker.compute_logprobs(batch), batch.rollout_logprobs, batch.loss_mask)
    metrics = worker.forward_backward(batch)
    sums = {k: v for k, v in metrics.items() if k in MISMATCH_SUMS}
    assert sums["mismatch_sums/n"] == 16.0
    expected, got = mismatch_metrics(whole), mismatch_metrics(sums)
    assert got.keys() == expected.keys() and "mismatch/prob_pearson" in got
    for key in expected:
        assert got[key] == pytest.approx(expected[key], rel=1e-5), key
