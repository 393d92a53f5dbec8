"""``engine.backend=inprocess``: hand the tensors to the engine in this process."""

from __future__ import annotations

from typing import Any

__all__ = ["InProcessTransport"]


class InProcessTransport:
    """Copies rank 0's parameters (in the worker's thread) and loads them into the engine."""

    async def init(self, engine: Any, workers: Any) -> None:
        return None

    async def transfer(self, workers: Any, engine: Any) -> None:
        named = await workers.named_weights()
        await engine.load_weights(named)
