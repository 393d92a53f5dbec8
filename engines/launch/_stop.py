"""Stopping a server's process group: SIGTERM, SIGKILL after a timeout, then the stragglers.

Both launchers stop a server this way, each waiting its own way: the trainer's child
processes from trio (a ``trio.Process``), a Ray-placed server from its actor's thread (a
``subprocess.Popen``). The escalation is written once, here; the caller closes the server's
stdin first and supplies ``wait(seconds) -> exited``::

    await stop_group(proc.pid, timeout_s, wait)            # trio
    stop_group_blocking(proc.pid, timeout_s, wait)         # a thread

The group gets SIGTERM and the leader ``timeout_s`` to exit; then SIGKILL and another
:data:`KILL_WAIT_S`. Once the leader is gone (or was SIGKILLed), the group gets SIGKILL again
so nothing it started lingers. A group that is already gone is not an error. The whole stop
is bounded by about ``timeout_s + KILL_WAIT_S`` seconds, whatever the server does.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Awaitable, Callable, Generator

__all__ = ["KILL_WAIT_S", "signal_group", "stop_group", "stop_group_blocking"]

#: Seconds the leader gets to be reaped after SIGKILL.
KILL_WAIT_S = 5.0


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process group ``pgid``; nothing when the group is gone already."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass  # the whole group is gone already


def _escalation(pgid: int, timeout_s: float) -> Generator[float, bool, None]:
    """Signal the group, then yield how long to wait for the leader; resume with whether it exited."""
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, KILL_WAIT_S)):
        signal_group(pgid, sig)
        if (yield wait_s):
            break
    signal_group(pgid, signal.SIGKILL)  # the leader is gone: make sure nothing of its group lingers


async def stop_group(pgid: int, timeout_s: float, wait: Callable[[float], Awaitable[bool]]) -> None:
    """Stop process group ``pgid`` from trio; ``await wait(s)`` waits up to ``s`` seconds for
    the leader and says whether it exited (see the module docstring)."""
    steps = _escalation(pgid, timeout_s)
    try:
        wait_s = next(steps)
        while True:
            wait_s = steps.send(await wait(wait_s))
    except StopIteration:
        return


def stop_group_blocking(pgid: int, timeout_s: float, wait: Callable[[float], bool]) -> None:
    """:func:`stop_group` for a thread: ``wait(s)`` blocks up to ``s`` seconds."""
    steps = _escalation(pgid, timeout_s)
    try:
        wait_s = next(steps)
        while True:
            wait_s = steps.send(wait(wait_s))
    except StopIteration:
        return
