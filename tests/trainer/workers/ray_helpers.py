"""What the Ray worker tests share: the policy's settings, a batch of the tiny model, and a wait
for the actors' processes to exit. The cluster is the suite's (``ray_cluster``, session-scoped
in ``tests/conftest.py``); the model, ``model_dir`` in this folder's ``conftest.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import trio

from tests.e2e.helpers import alive_after
from trainer.workers.batch import TrainBatch

__all__ = ["POLICY_KWARGS", "flat_grad", "make_batch", "wait_gone"]

POLICY_KWARGS: dict[str, Any] = dict(lr=1e-3, max_grad_norm=1e9, seed=0)


def make_batch(model_dir: Path, rows: int = 5, width: int = 12, seed: int = 0) -> TrainBatch:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    attn[0, -3:] = 0  # a padded row
    mask = torch.zeros(rows, width - 1)
    mask[:, 4:] = 1.0
    mask[0, -3:] = 0.0
    return TrainBatch(
        input_ids=ids,
        attention_mask=attn,
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(rows, width - 1, generator=g),
    )


async def wait_gone(pids: list[int]) -> list[int]:
    """Of ``pids``, those still alive after a bounded wait (the actors' processes exit)."""
    return await trio.to_thread.run_sync(alive_after, pids, 30.0)


def flat_grad(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
