"""Ctrl-C: stop the run cleanly, say where it was, and let a second Ctrl-C kill it at once.

::

    async with stop_on_interrupt(lambda: where_line(dumper.local()), grace_s=60):
        await run_everything()

Inside the block, SIGINT no longer raises ``KeyboardInterrupt`` wherever the trio thread
happens to be (in the middle of a metrics line, between a checkpoint's rename and its
``latest`` pointer). Instead the first Ctrl-C:

1. logs one line with where the run was (``describe()``, e.g. ``step 3 (stage='generate',
   operation='generate')``) to ``train.log`` and stderr;
2. restores the default SIGINT action, so a second Ctrl-C kills the process at once (no
   clean-up, like any process killed by a signal; checkpoints stay consistent because they
   are written to a temporary directory and renamed);
3. cancels the block: every step, stage and server unwinds as for any cancellation (shielded
   transfers finish first, engines and workers are stopped), and once it has,
   ``KeyboardInterrupt("interrupted at <where>; stopped in 1.2s")`` is raised.

If the block has not stopped ``grace_s`` seconds after the first Ctrl-C, the watcher does what
the second Ctrl-C would (the default SIGINT action, sent to this process). Outside the main
thread (where signals cannot be caught) the block runs unguarded.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from trainer.vocabulary import open_owner_nursery

__all__ = ["stop_on_interrupt"]

log = logging.getLogger("trainer.run")


async def _first_interrupt(
    signals: AsyncIterator[int],
    body: trio.CancelScope,
    describe: Callable[[], str],
    grace_s: float,
    said: list[tuple[str, float]],
) -> None:
    async for _ in signals:
        break
    else:
        return
    where = describe()
    said.append((where, trio.current_time()))
    log.warning("Ctrl-C at %s: stopping (press Ctrl-C again to kill at once)", where)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    body.cancel()
    await trio.sleep(grace_s)
    log.error("the run did not stop within %gs of Ctrl-C: killing it", grace_s)
    os.kill(os.getpid(), signal.SIGINT)


@asynccontextmanager
async def stop_on_interrupt(describe: Callable[[], str], *, grace_s: float) -> AsyncIterator[None]:
    """Run the block with Ctrl-C turned into a clean stop (see the module docstring).

    Raises ``KeyboardInterrupt`` with where the run was, after the block has unwound; an
    error the block raised while stopping becomes its ``__cause__``. Without a Ctrl-C the
    block's own outcome passes through unchanged.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    said: list[tuple[str, float]] = []
    error: BaseException | None = None
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        try:
            async with open_owner_nursery() as nursery:
                body = trio.CancelScope()
                nursery.start_soon(_first_interrupt, signals, body, describe, grace_s, said)
                try:
                    with body:
                        yield
                finally:
                    nursery.cancel_scope.cancel()
        except BaseException as exc:
            if not said:
                raise
            error = exc
    if said:
        where, at = said[0]
        raise KeyboardInterrupt(
            f"interrupted at {where}; stopped in {trio.current_time() - at:.1f}s"
        ) from error
