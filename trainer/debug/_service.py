"""Everything a run does so that it can be looked into, opened and closed as one block."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trainer.debug._server import debug_paths, serve_debug_socket, stack_signal
from trainer.debug._snapshot import Dumper
from trainer.vocabulary import open_owner_nursery

__all__ = ["open_debug_services"]


@asynccontextmanager
async def open_debug_services(dumper: Dumper) -> AsyncIterator[trio.Nursery]:
    """Install ``dumper``'s wait clock, serve the debug socket, let ``SIGUSR1`` write stacks.

    Yields the nursery that owns the socket's task, for other watchers of the run (the
    watchdog). On exit, whatever the body did, those tasks are cancelled, the socket and
    ``debug.json`` removed and the instrument and signal handler uninstalled; the body's
    error propagates as itself (:func:`~trainer.vocabulary.open_owner_nursery`).
    """
    _, stacks = debug_paths(os.getpid())
    trio.lowlevel.add_instrument(dumper.clock)
    try:
        with stack_signal(stacks):
            async with open_owner_nursery() as nursery:
                await nursery.start(serve_debug_socket, dumper)
                yield nursery
                nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(dumper.clock)
