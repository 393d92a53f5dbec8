"""A batch that gets one optimizer step takes its old logprobs from the update's own forward:
the same gradient and metrics as a separate no-grad forward first, one forward fewer."""

from __future__ import annotations

import pytest
import torch

from engines.models import build_tiny_model
from trainer.algorithms import RolloutCorrection
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
    assert metrics[0].keys() == metrics[1].keys()
    assert "policy/is_ratio_mean" in metrics[0]
    for key in metrics[0]:
        assert metrics[0][key] == pytest.approx(metrics[1][key], rel=1e-5, abs=1e-6), key
