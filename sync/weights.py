"""``save_weights_for_sampler``: push the policy's weights to the inference engines.

The bracket (non-colocated default): pause generation (``engine.pause_mode``), transfer,
resume — the resume in a cleanup bracket, so a failed or cancelled transfer still resumes
generation, within what is left of the step's budget. The transfer runs off the event loop:
the worker writes or copies weights in its own thread, engines load them in theirs.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import trio

from sync.transports.base import WeightTransport
from trainer import faults
from trainer.deadline import cleanup_bracket, operation

__all__ = ["save_weights_for_sampler"]


class _Engine(Protocol):
    async def pause(self, mode: Any = "keep") -> None: ...
    async def resume(self) -> None: ...


async def save_weights_for_sampler(
    workers: Any, engine: _Engine, transport: WeightTransport, *, pause_mode: str = "keep"
) -> dict[str, float]:
    """Pause, transfer, resume (always); returns ``sync/last_weight_sync_seconds``."""
    await engine.pause(pause_mode)
    async with cleanup_bracket(engine.resume, "/resume"):
        with operation("broadcast_to_inference_engines"):
            t0 = time.perf_counter()
            # the fault fires where the transfer runs: a thread, never the event loop
            await trio.to_thread.run_sync(
                faults.fire_sync, "broadcast_to_inference_engines", abandon_on_cancel=True
            )
            await transport.transfer(workers, engine)
            transfer_s = time.perf_counter() - t0
    return {"sync/last_weight_sync_seconds": transfer_s}
