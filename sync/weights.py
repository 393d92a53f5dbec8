"""``save_weights_for_sampler``: push the policy's weights to the inference engines.

The bracket (non-colocated default): pause generation (``engine.pause_mode``), transfer,
resume — the resume in a cleanup bracket, so a failed or cancelled transfer still resumes
generation, within what is left of the step's budget. The transfer itself runs off the
event loop (the worker group copies weights in its thread; the engine loads them in its
own thread between two decode steps).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch
import trio

from trainer import faults
from trainer.deadline import cleanup_bracket, operation

__all__ = ["SyncResult", "save_weights_for_sampler"]


class _Engine(Protocol):
    async def pause(self, mode: Any = "keep") -> None: ...
    async def resume(self) -> None: ...
    async def load_weights(self, named: dict[str, torch.Tensor]) -> None: ...


class _Weights(Protocol):
    async def named_weights(self) -> dict[str, torch.Tensor]: ...


class SyncResult(dict[str, float]):
    """Metrics of one sync: ``sync/last_weight_sync_seconds`` (the transfer alone)."""


async def save_weights_for_sampler(
    workers: _Weights, engine: _Engine, *, pause_mode: str = "keep"
) -> SyncResult:
    """Pause, transfer, resume (always); returns the sync's metrics."""
    await engine.pause(pause_mode)
    async with cleanup_bracket(engine.resume, "/resume"):
        with operation("broadcast_to_inference_engines"):
            t0 = time.perf_counter()
            # the fault fires where the transfer runs: a thread, never the event loop
            await trio.to_thread.run_sync(
                faults.fire_sync, "broadcast_to_inference_engines", abandon_on_cancel=True
            )
            named = await workers.named_weights()
            await engine.load_weights(named)
            transfer_s = time.perf_counter() - t0
    return SyncResult({"sync/last_weight_sync_seconds": transfer_s})
