"""Everything a run does so that it can be looked into, opened and closed as one block."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trainer.debug._private import UnsafePathError
from trainer.debug._server import debug_paths, serve_debug_socket, stack_signal
from trainer.debug._snapshot import Dumper
from trainer.vocabulary import open_owner_nursery

__all__ = ["open_debug_services"]

log = logging.getLogger("trainer.debug")


@asynccontextmanager
async def open_debug_services(dumper: Dumper) -> AsyncIterator[trio.Nursery]:
    """Install ``dumper``'s wait clock, serve the debug socket, let ``SIGUSR1`` write stacks.

    Yields the nursery that owns the socket's task, for other watchers of the run (the
    watchdog). On exit, whatever the body did, those tasks are cancelled, the socket and
    ``debug.json`` removed and the instrument and signal handler uninstalled; the body's
    error propagates as itself (:func:`~trainer.vocabulary.open_owner_nursery`).

    Where the debug folder (``$TMPDIR/trainer-debug-UID``) or the stacks file in it fails the
    private-folder check (another user's, writable by others, a link), the run goes on
    without the socket and the stacks signal, after one warning naming the folder: the
    folder is left untouched. Refusing the run instead would let any user of the host stop
    everyone's training by making their folders first; the debug socket is a window into the
    run, not a part of it.
    """
    _, stacks = debug_paths(os.getpid())
    trio.lowlevel.add_instrument(dumper.clock)
    try:
        with contextlib.ExitStack() as signal_stack:
            try:
                signal_stack.enter_context(stack_signal(stacks))
                reachable = True
            except UnsafePathError as exc:
                log.warning(
                    "%s. This run goes on without its debug socket (`python -m trainer debug "
                    "dump` cannot reach it)",
                    exc,
                )
                reachable = False
            async with open_owner_nursery() as nursery:
                if reachable:
                    await nursery.start(serve_debug_socket, dumper)
                yield nursery
                nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(dumper.clock)
