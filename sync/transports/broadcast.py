"""``sync.transport=broadcast``: a torch.distributed group from policy rank 0 to the engines.

The group (gloo on CPU; vLLM would use NCCL) has policy rank 0 as rank 0 (wherever rank 0
runs: a thread of the trainer with local workers, rank 0's actor with Ray workers) and each
engine server as rank ``1 + i``. It is built once, through :func:`sync.group.init_group`'s
controller-side bound, and reused by every sync. The transfer follows vLLM's four-phase
protocol::

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
                                        "rank_offset", "world_size", "backend": "gloo"}}   once
    POST /start_weight_update         {}
    POST /update_weights              {"update_info": {"names", "dtype_names", "shapes"}}   per bucket
    POST /finish_weight_update        {}    the engine applies the staged weights atomically

For each bucket the ``/update_weights`` calls and rank 0's broadcast of the bucket run
together: every server receives into a fresh buffer in a thread and stages it; rank 0
flattens the bucket's parameters into one buffer (at most ``bucket_bytes`` beyond the
model, never a second full copy) and broadcasts it. Its collective waits are bounded by the
step's remaining budget (``remaining()``) or, without one, by ``timeout_s``.

Both halves: the functions below marked "rank 0" run where rank 0 runs (through
``workers.run_on_rank0``); the engine side is ``engines/local/weight_routes.py`` (backend
``gloo``). The groups a process joined as rank 0 are kept in that process, by name, until
:meth:`BroadcastTransport.close`.
"""

from __future__ import annotations

import functools
import math
import uuid
from typing import Any

import torch
import trio

from engines.process_group import BACKSTOP_S, GroupHandle, free_port, join_group
from sync.group import init_group
from sync.transports.base import Rank0
from sync.transports.buckets import plan_buckets, update_info
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import open_owner_nursery, operation, remaining

__all__ = [
    "GROUP",
    "BroadcastTransport",
    "broadcast_bucket",
    "group_endpoint",
    "host_group",
    "hosted_groups",
    "leave_group",
    "weight_buckets",
]

#: The name errors and logs give the weight-sync group.
GROUP = "weight_sync"
INIT_OP = "init_process_group"

#: Rank 0's side of the groups this process joined, by group id.
_hosted: dict[str, GroupHandle] = {}


def group_endpoint(model: torch.nn.Module, host: str | None) -> tuple[str, int]:
    """Rank 0: where it hosts the group's store, and a free port there.

    ``host`` None: this node's Ray address when Ray runs in rank 0's process (a Ray worker,
    or a trainer whose engines Ray placed), else loopback.
    """
    if host is None:
        import ray  # importing Ray costs seconds: only when no address was given

        host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
    return host, free_port(host)


def host_group(
    model: torch.nn.Module,
    group_id: str,
    host: str,
    port: int,
    world_size: int,
    store_timeout_s: float,
) -> None:
    """Rank 0: host and join the group (blocks until every rank joined or the store times out)."""
    _hosted[group_id] = join_group(
        GROUP,
        master_address=host,
        master_port=port,
        rank=0,
        world_size=world_size,
        store_timeout_s=store_timeout_s,
    )


def weight_buckets(model: torch.nn.Module, bucket_bytes: int) -> list[dict[str, Any]]:
    """Rank 0: vLLM's ``update_info`` per bucket (one dtype each, at most ``bucket_bytes``)."""
    return [
        update_info(b) for b in plan_buckets(model.named_parameters(), bucket_bytes, one_dtype=True)
    ]


def broadcast_bucket(
    model: torch.nn.Module, group_id: str, names: list[str], timeout_s: float
) -> None:
    """Rank 0: broadcast the named parameters as one flat buffer (blocking, ``timeout_s``)."""
    group = _hosted.get(group_id)
    if group is None:
        raise RuntimeError(f"broadcast of a bucket before rank 0 joined group {group_id!r}")
    params = dict(model.named_parameters())
    with torch.no_grad():
        flat = torch.cat([params[n].detach().reshape(-1) for n in names])
    group.broadcast(flat, 0, timeout_s=timeout_s)


def hosted_groups() -> dict[str, GroupHandle]:
    """The groups this process hosts as rank 0, by group id (a copy)."""
    return dict(_hosted)


def leave_group(model: torch.nn.Module, group_id: str) -> bool:
    """Rank 0: forget the group (its store closes with the handle); whether it was joined."""
    return _hosted.pop(group_id, None) is not None


class BroadcastTransport:
    """Rank 0 of the weight-sync group; ``init`` builds the group once, ``transfer`` reuses it."""

    def __init__(
        self,
        bucket_bytes: int,
        *,
        group_init_timeout_s: float,
        timeout_s: float = 1800.0,
        master_address: str | None = None,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.group_init_timeout_s = group_init_timeout_s
        #: Bound of one collective when the step has no deadline (the group's own watchdog).
        self.timeout_s = timeout_s
        #: Where rank 0 hosts the group; None: rank 0's node address (see group_endpoint).
        self.master_address = master_address
        #: This transport's group, unique in rank 0's process.
        self.group_id = f"{GROUP}-{uuid.uuid4().hex[:8]}"
        self.initialized = False

    async def init(self, engine: Any, workers: Rank0) -> None:
        """Build the group (policy rank 0, one rank per server) within ``group_init_timeout_s``.

        Raises ``CheckpointEngineInitError`` past the bound, or the first participant's own
        error (a server's 4xx, ``FaultInjected``) unchanged. Once built, a second call is a
        no-op.
        """
        if self.initialized:
            return
        urls = list(engine.urls)
        world_size = 1 + len(urls)
        # one bound for the whole init: asking rank 0 where to host, then every join
        with operation(INIT_OP), trio.move_on_after(self.group_init_timeout_s) as scope:
            await self._build(engine, workers, urls, world_size)
        if scope.cancelled_caught:
            raise CheckpointEngineInitError(GROUP, self.group_init_timeout_s)
        self.initialized = True

    async def _build(self, engine: Any, workers: Rank0, urls: list[str], world_size: int) -> None:
        """Rank 0's endpoint, then every participant's join (unbounded here: see ``init``)."""
        host, port = await workers.run_on_rank0(
            group_endpoint, self.master_address, abandon_on_cancel=True
        )
        store_timeout_s = max(self.group_init_timeout_s + BACKSTOP_S, self.timeout_s)

        async def rank0_join() -> None:
            await workers.run_on_rank0(
                host_group,
                self.group_id,
                host,
                port,
                world_size,
                store_timeout_s,
                abandon_on_cancel=True,
            )

        def server_join(i: int, url: str):
            init_info = {
                "master_address": host,
                "master_port": port,
                "rank_offset": 1 + i,
                "world_size": world_size,
                "backend": "gloo",
                "group_timeout_s": store_timeout_s,
            }

            async def join() -> None:
                # one server at a time: each has its own rank_offset
                await engine.control_one(
                    url, "POST", "/init_weight_transfer_engine", json={"init_info": init_info}
                )

            return join

        joins = [rank0_join, *(server_join(i, u) for i, u in enumerate(urls))]
        await init_group(GROUP, joins, timeout_s=math.inf)  # init() bounds the whole

    async def transfer(self, engine: Any, workers: Rank0) -> None:
        if not self.initialized:
            raise RuntimeError("BroadcastTransport.transfer before init")
        buckets = await workers.run_on_rank0(weight_buckets, self.bucket_bytes)
        await engine.control("POST", "/start_weight_update", json={})
        for bucket in buckets:
            left = remaining()
            timeout_s = self.timeout_s if left is None else max(left, 0.001)
            async with open_owner_nursery() as nursery:
                update = functools.partial(
                    engine.control, "POST", "/update_weights", json={"update_info": bucket}
                )
                nursery.start_soon(update)
                nursery.start_soon(
                    functools.partial(
                        workers.run_on_rank0,
                        broadcast_bucket,
                        self.group_id,
                        bucket["names"],
                        timeout_s,
                    )
                )
        await engine.control("POST", "/finish_weight_update", json={})

    async def close(self, workers: Rank0) -> None:
        """Rank 0 leaves the group (the engines' side ends with their servers)."""
        if self.initialized:
            self.initialized = False
            await workers.run_on_rank0(leave_group, self.group_id)
