"""``engine.backend=inprocess``: hand the tensors to the engine in this process."""

from __future__ import annotations

from typing import Any

import torch

from sync.transports.base import Rank0

__all__ = ["InProcessTransport", "copy_weights"]


def copy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: detached copies of every parameter, as the engines name them."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


class InProcessTransport:
    """Copies rank 0's parameters (where rank 0 runs) and loads them into the engine."""

    async def init(self, engine: Any, workers: Rank0) -> None:
        return None

    async def transfer(self, engine: Any, workers: Rank0) -> None:
        await engine.load_weights(await workers.run_on_rank0(copy_weights))

    async def close(self, workers: Rank0) -> None:
        return None
