"""``save_weights_for_sampler``: push the policy's weights to the inference engines.

The engine bracket around the transfer depends on where the engines live:

- non-colocated (default): pause generation (``engine.pause_mode``) -> transfer -> resume,
  the resume in a cleanup bracket;
- colocated (``engine.colocated``): wake weights -> transfer -> wake kv_cache, the KV wake
  in a cleanup bracket;
- ``engine.offload_kv_for_weight_sync`` with the synchronous trainer: sleep -> wake
  weights -> transfer, the KV wake in a cleanup bracket;
- the same with the fully-async trainer: pause -> sleep -> wake weights -> transfer ->
  wake kv_cache -> resume, the KV wake its own cleanup bracket *inside* the resume bracket,
  so a failed or cancelled transfer still wakes the KV cache before generation resumes.

Cleanups run as DESIGN 3 rule 7 says (what is left of the step's budget; skipped with a
note once it has passed).

The transfer (DESIGN 3 rule 6) runs where the step does not abandon it: in a shielded
scope whose deadline is the step's deadline, its blocking parts in threads that are not
abandoned. A cancellation that lands mid-transfer therefore waits for the transfer to
finish (its waits bounded by the remaining budget) and then propagates; if the transfer
failed, the error raised is chained (``__cause__``) to the transfer's error. Generation is
never resumed while the transfer is still writing.

``sync/last_weight_sync_seconds`` is the transfer alone (the bracket is ``timing/sync_weights``).
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from engines.types import EngineClient, PauseMode
from sync.transports.base import Rank0, WeightTransport
from trainer.vocabulary import (
    cleanup_bracket,
    current_deadline,
    fire_fault_sync,
    operation,
    pending_deadline_error,
)

__all__ = ["TRANSFER_ON_EVENT_LOOP_ENV", "run_transfer", "save_weights_for_sampler"]

OP = "broadcast_to_inference_engines"
#: Test-only: set to 1, the transfer's fault (a slow transfer, ``sleep=S``) blocks the trio
#: thread instead of a worker thread, as a transfer run on the event loop would (SkyRL
#: #2524); tests/e2e/test_fully_async_cli.py shows what that does to rollouts in flight.
TRANSFER_ON_EVENT_LOOP_ENV = "TRAINER_TEST_TRANSFER_ON_EVENT_LOOP"


async def run_transfer(transfer: Callable[[], Awaitable[object]]) -> float:
    """Run ``transfer()`` to completion even if cancelled; return its wall seconds.

    It runs in a shielded scope bounded by the step's deadline: a cancellation from outside
    waits for it, then propagates at the next checkpoint. If the transfer failed after a
    cancellation, the deadline's typed error (or the failure itself, for a cancellation
    that is not a deadline's) is raised with the transfer's error as ``__cause__``.
    """
    t0 = time.perf_counter()
    failure: BaseException | None = None
    with operation(OP):
        with trio.CancelScope(shield=True, deadline=current_deadline()):
            try:
                # the fault fires where the transfer runs: a thread the step does not abandon
                if os.environ.get(TRANSFER_ON_EVENT_LOOP_ENV) == "1":
                    _block_event_loop_on_fault()
                else:
                    await trio.to_thread.run_sync(fire_fault_sync, OP)
                await transfer()
            except Exception as exc:
                failure = exc
        elapsed = time.perf_counter() - t0
        if failure is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            return elapsed
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled as cancelled:
            typed = pending_deadline_error(failure, OP)
            if typed is not None:
                raise typed from failure
            raise cancelled from failure
        raise failure


def _block_event_loop_on_fault() -> None:
    """The test-only wrong way (``TRANSFER_ON_EVENT_LOOP_ENV``): the trio thread waits for
    the transfer's fault, blocked, as if the transfer ran on it."""
    context = contextvars.copy_context()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(context.run, fire_fault_sync, OP).result()


async def _transfer_and_record(
    engine: Any, workers: Rank0, transport: WeightTransport, out: dict[str, float]
) -> None:
    out["sync/last_weight_sync_seconds"] = await run_transfer(
        lambda: transport.transfer(engine, workers)
    )


async def save_weights_for_sampler(
    engine: EngineClient,
    workers: Rank0,
    transport: WeightTransport,
    *,
    pause_mode: PauseMode = "keep",
    colocated: bool = False,
    offload_kv: bool = False,
    fully_async: bool = False,
) -> dict[str, float]:
    """Transfer the policy's weights inside the engine bracket; return the sync's metrics.

    ``sync/last_weight_sync_seconds`` is the transfer alone. Raises the transfer's error,
    or the step deadline's typed error chained to it; cleanups never replace it.
    """
    out: dict[str, float] = {}
    if colocated:
        await engine.wake_up(["weights"])
        async with _wake_kv_after(engine):
            await _transfer_and_record(engine, workers, transport, out)
    elif offload_kv and fully_async:
        await engine.pause(pause_mode)
        async with cleanup_bracket(engine.resume, "/resume"):
            await engine.sleep(1)
            await engine.wake_up(["weights"])
            async with _wake_kv_after(engine):
                await _transfer_and_record(engine, workers, transport, out)
    elif offload_kv:
        await engine.sleep(1)
        await engine.wake_up(["weights"])
        async with _wake_kv_after(engine):
            await _transfer_and_record(engine, workers, transport, out)
    else:
        await engine.pause(pause_mode)
        async with cleanup_bracket(engine.resume, "/resume"):
            await _transfer_and_record(engine, workers, transport, out)
    return out


def _wake_kv_after(engine: EngineClient):
    async def wake_kv() -> None:
        await engine.wake_up(["kv_cache"])

    return cleanup_bracket(wake_kv, "/wake_up")
