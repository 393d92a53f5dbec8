"""A stateless weight-sync process group: one ``TCPStore`` plus one ``ProcessGroupGloo``.

The primitive both ends of the broadcast transport use: policy rank 0 in the trainer
(through :mod:`sync.group`, which bounds the init on the controller side) and the reference
server's ``/init_weight_transfer_engine`` (which joins in a thread). It lives here because
engines may not import ``sync``. No ``torch.distributed`` global (default-group) state is
touched, as with vLLM's weight-transfer groups.
"""

from __future__ import annotations

import datetime
import socket
from typing import Any

import attrs
import torch
import torch.distributed as dist

from trainer.vocabulary import fire_fault_sync

__all__ = ["BACKSTOP_S", "GroupHandle", "free_port", "join_group"]

OP = "init_process_group"

#: Added to the controller's bound for a participant's own store timeout, so a thread the
#: controller gave up on ends on its own instead of staying blocked for the process' life.
BACKSTOP_S = 5.0


@attrs.define(eq=False)
class GroupHandle:
    """One participant's membership in a built group (reused by every sync)."""

    #: The group's name (in errors and logs).
    name: str
    #: This participant's rank and the group's size.
    rank: int
    world_size: int
    #: The store (rank 0 hosts it) and the gloo group over it.
    store: Any
    group: Any

    def broadcast(
        self, tensor: torch.Tensor, src: int = 0, *, timeout_s: float | None = None
    ) -> None:
        """Blocking broadcast of ``tensor`` from ``src`` (call it from a thread, never the loop).

        ``timeout_s`` bounds this collective (default: the group's own timeout).
        """
        timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
        self.group.broadcast(tensor, src, timeout).wait()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for a group's store)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def join_group(
    name: str,
    *,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    store_timeout_s: float,
    step: int | None = None,
) -> GroupHandle:
    """Join (rank 0: host) group ``name``; blocking, so run it in a thread or a process.

    Fires the ``init_process_group`` fault first (where the init really runs). Blocks until
    every rank has joined or ``store_timeout_s`` passes (the participant's backstop; the
    controller's bound is :func:`init_group`'s).
    """
    fire_fault_sync(OP, step)
    timeout = datetime.timedelta(seconds=store_timeout_s)
    store = dist.TCPStore(
        master_address,
        master_port,
        world_size,
        is_master=rank == 0,
        timeout=timeout,
        wait_for_workers=False,
    )
    prefixed = dist.PrefixStore(f"{name}/", store)
    group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    return GroupHandle(name, rank, world_size, store, group)
