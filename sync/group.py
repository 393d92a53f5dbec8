"""Weight-sync process groups, initialised with a fail-fast bound on the controller side.

Every participant of a group (policy rank 0 in a thread of the trainer, each engine
server in a thread of its own process) starts its part of the rendezvous where it runs;
the trainer only *waits* for their init futures. That wait is what is bounded:
:func:`init_group` gives all participants together ``sync.group_init_timeout_s``
(env ``TRAINER_GROUP_INIT_TIMEOUT_S``, default 600 s) and then raises
:class:`~trainer.errors.CheckpointEngineInitError` naming the group, the timeout and the
setting to raise. A thread inside a participant never times the init out on the
controller's behalf (a thread left blocked in a collective keeps half-initialised state);
the participant's store has a longer backstop timeout only so that an abandoned thread
ends eventually. The init's own error (bad address, ``FaultInjected``, a server's 4xx) is
re-raised unchanged. There is no retry in place: the trainer tears down what it started
and exits. A group is built once and reused by every sync (see
:class:`engines.process_group.GroupHandle`).

Groups are *stateless* with respect to ``torch.distributed``'s global default group: each
one is its own ``TCPStore`` plus ``ProcessGroupGloo``, as vLLM's weight-transfer groups
are, so the trainer's own process groups (if any) are untouched.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import trio

from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import open_owner_nursery, operation

__all__ = ["init_group"]

OP = "init_process_group"

T = TypeVar("T")


async def init_group(
    name: str, joins: Sequence[Callable[[], Awaitable[T]]], *, timeout_s: float
) -> list[T]:
    """Wait for every participant's init, all within ``timeout_s``; their results in order.

    Raises :class:`CheckpointEngineInitError` when they have not all finished in time (the
    participants are left to the caller's teardown), or the first init error unchanged.
    """
    results: dict[int, T] = {}

    async def wait_one(i: int, join: Callable[[], Awaitable[T]]) -> None:
        results[i] = await join()

    with operation(OP):
        with trio.move_on_after(timeout_s) as scope:
            async with open_owner_nursery() as nursery:
                for i, join in enumerate(joins):
                    nursery.start_soon(wait_one, i, join)
        if scope.cancelled_caught:
            raise CheckpointEngineInitError(name, timeout_s)
    return [results[i] for i in range(len(joins))]
