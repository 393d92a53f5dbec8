"""``engine.backend=inprocess``: hand the tensors to the engine in this process."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from engines.types import EngineClient
from sync.transports.base import Rank0

__all__ = ["InProcessTransport", "copy_weights"]


def copy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Rank 0: detached copies of every parameter, as the engines name them."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@runtime_checkable
class _LoadsWeights(Protocol):
    """An engine in this process that takes the tensors themselves
    (``engines.local.inprocess.InProcessClient``)."""

    async def load_weights(
        self, named: dict[str, torch.Tensor], *, weight_version: int | None = None
    ) -> None: ...


class InProcessTransport:
    """Copies rank 0's parameters (where rank 0 runs) and loads them into the engine."""

    #: Tensor bytes of the last transfer (``sync/bytes``).
    last_bytes = 0

    async def init(self, engine: EngineClient, workers: Rank0) -> None:
        return None

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None:
        """``TypeError`` for an engine that does not take tensors (one behind a server). The
        engine takes ``weight_version`` as its own (None: it counts one more)."""
        if not isinstance(engine, _LoadsWeights):
            raise TypeError(
                f"{type(engine).__name__} does not load weights in this process: "
                "sync.transport=inprocess needs engine.backend=inprocess"
            )
        named = await workers.run_on_rank0(copy_weights)
        self.last_bytes = sum(t.numel() * t.element_size() for t in named.values())
        await engine.load_weights(named, weight_version=weight_version)

    async def close(self, workers: Rank0) -> None:
        return None
