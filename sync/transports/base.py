"""The transport interface ``save_weights_for_sampler`` drives."""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["WeightTransport"]


class WeightTransport(Protocol):
    """Moves the policy's current weights into every engine.

    ``transfer`` runs inside ``operation("broadcast_to_inference_engines")`` with generation
    paused; it returns once every engine serves the new weights (applied atomically with
    respect to requests, by the engine).
    """

    async def init(self, engine: Any, workers: Any) -> None:
        """Once, before the first transfer (engines up, workers created)."""
        ...

    async def transfer(self, workers: Any, engine: Any) -> None: ...
