"""A step's metrics over several mini-batches: means averaged, extremes kept as extremes (a
``*_max`` is the largest of the mini-batches', not a mean of maxima)."""

from __future__ import annotations

import types

import pytest
import torch
import trio

from trainer.config import load_config
from trainer.loop._stages import train_critic_and_policy
from trainer.workers.batch import TrainBatch
from trainer.workers.training import add_metrics, extreme


class _Group:
    """The worker group's calls the stage makes; each mini-batch's metrics given in advance."""

    def __init__(self, per_mini_batch: list[dict[str, float]]) -> None:
        self.left = list(per_mini_batch)
        self.rows: list[int] = []

    async def backload_to_gpu(self) -> dict[str, float]:
        return {}

    async def offload_to_cpu(self) -> dict[str, float]:
        return {}

    async def forward_backward(self, batch: TrainBatch, counts) -> dict[str, float]:
        self.rows.append(batch.input_ids.shape[0])
        return self.left.pop(0)

    async def optim_step(self) -> dict[str, float]:
        return {}


def test_two_mini_batches_average_means_and_keep_extremes():
    cfg = load_config(None, ["trainer.policy_mini_batch_size=1"])  # one prompt group each
    group = _Group(
        [
            {"policy/loss": 1.0, "policy/ratio_max": 1.5, "policy/ratio_min": 0.9},
            {"policy/loss": 3.0, "policy/ratio_max": 1.1, "policy/ratio_min": 0.5},
        ]
    )
    ids = torch.ones(4, 5, dtype=torch.long)
    batch = TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        loss_mask=torch.ones(4, 4),
        advantages=torch.zeros(4, 4),
    )
    ctx = types.SimpleNamespace(cfg=cfg, workers=group)
    metrics = trio.run(train_critic_and_policy, ctx, 1, batch, [0, 0, 1, 1])
    assert group.rows == [2, 2]
    assert metrics == {"policy/loss": 2.0, "policy/ratio_max": 1.5, "policy/ratio_min": 0.5}


@pytest.mark.parametrize(
    ("key", "fold"), [("policy/ratio_max", max), ("critic/values_min", min), ("policy/loss", None)]
)
def test_one_rule_names_the_extremes_for_micro_batches_ranks_and_mini_batches(key, fold):
    assert extreme(key) is fold
    totals: dict[str, float] = {}
    add_metrics(totals, {key: 2.0}, 0.25)
    add_metrics(totals, {key: 4.0}, 0.75)
    assert totals[key] == {max: 4.0, min: 2.0, None: 3.5}[fold]
