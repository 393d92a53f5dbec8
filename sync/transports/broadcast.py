"""``sync.transport=broadcast``: a torch.distributed group from policy rank 0 to the engines.

The group (gloo on CPU; vLLM would use NCCL) has policy rank 0 (a thread of the trainer
process with local workers, rank 0's actor with Ray workers: the worker group hosts it and
keeps its handle) as rank 0 and each engine server as rank ``1 + i``; it is built once, through
:func:`sync.group.init_group`'s controller-side bound, and reused by every sync. The
transfer follows vLLM's four-phase protocol::

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
                                        "rank_offset", "world_size", "backend": "gloo"}}   once
    POST /start_weight_update         {}
    POST /update_weights              {"update_info": {"names", "dtype_names", "shapes"}}   per bucket
    POST /finish_weight_update        {}    the engine applies the staged weights atomically

For each bucket the ``/update_weights`` calls and rank 0's broadcast of the bucket run
together: every server receives into a fresh buffer in a thread and stages it; rank 0
flattens the bucket's parameters into one buffer (at most ``bucket_bytes`` beyond the
model, never a second full copy) and broadcasts it from the policy worker's thread. Its
collective waits are bounded by the step's remaining budget (``remaining()``) or, without
one, by ``timeout_s``.
"""

from __future__ import annotations

import functools
from typing import Any

import trio

from sync.group import BACKSTOP_S, init_group
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import open_owner_nursery, remaining

__all__ = ["BroadcastTransport"]

GROUP = "weight_sync"


class BroadcastTransport:
    """Rank 0 of the weight-sync group; ``init`` builds the group once, ``transfer`` reuses it."""

    def __init__(
        self,
        bucket_bytes: int,
        *,
        group_init_timeout_s: float,
        timeout_s: float = 1800.0,
        master_address: str = "127.0.0.1",
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.group_init_timeout_s = group_init_timeout_s
        #: Bound of one collective when the step has no deadline (the group's own watchdog).
        self.timeout_s = timeout_s
        #: Where rank 0 hosts the group when it runs in this process (local workers).
        self.master_address = master_address
        self.initialized = False

    async def init(self, engine: Any, workers: Any) -> None:
        """Build the group (policy rank 0, one rank per server) within ``group_init_timeout_s``.

        Rank 0 is hosted where the workers put it (``workers.weight_sync_endpoint``: this
        process for local workers, rank 0's node for Ray workers). Raises
        ``CheckpointEngineInitError`` past the bound, or the first participant's own error (a
        server's 4xx, ``FaultInjected``) unchanged. Once built, a second call is a no-op.
        """
        if self.initialized:
            return
        urls = list(engine.urls)
        world_size = 1 + len(urls)
        with trio.move_on_after(self.group_init_timeout_s) as scope:  # rank 0 may be remote
            host, port = await workers.weight_sync_endpoint(self.master_address)
        if scope.cancelled_caught:
            raise CheckpointEngineInitError(GROUP, self.group_init_timeout_s)
        store_timeout_s = max(self.group_init_timeout_s + BACKSTOP_S, self.timeout_s)
        rank0 = workers.join_weight_sync(GROUP, host, port, world_size, store_timeout_s)

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
                await engine._control_one(
                    url, "POST", "/init_weight_transfer_engine", None, {"init_info": init_info}
                )

            return join

        joins = [rank0, *(server_join(i, u) for i, u in enumerate(urls))]
        await init_group(GROUP, joins, timeout_s=self.group_init_timeout_s)
        self.initialized = True

    async def transfer(self, workers: Any, engine: Any) -> None:
        if not self.initialized:
            raise RuntimeError("BroadcastTransport.transfer before init")
        buckets = await workers.weight_buckets(self.bucket_bytes)
        await engine.control("POST", "/start_weight_update", json={})
        for bucket in buckets:
            left = remaining()
            timeout_s = self.timeout_s if left is None else max(left, 0.001)
            async with open_owner_nursery() as nursery:
                update = functools.partial(
                    engine.control, "POST", "/update_weights", json={"update_info": bucket}
                )
                nursery.start_soon(update)
                nursery.start_soon(workers.broadcast_bucket, bucket["names"], timeout_s)
        await engine.control("POST", "/finish_weight_update", json={})
