"""``sync.transport=gloo|nccl``: a collective group from policy rank 0 to the engines.

vLLM's ``nccl`` weight-transfer backend, and its CPU stand-in ``gloo`` that sends the very
same messages. The group has policy rank 0 as rank 0 (wherever rank 0 runs: a thread of
the trainer with local workers, rank 0's actor with Ray workers) and every worker of every
engine: engine ``i`` of ``/get_world_size`` N (a vLLM engine's tensor-parallel ranks) joins as
ranks ``rank_offset .. rank_offset + N - 1``, after the engines before it. Rank 0 hosts it at
``master_address`` (``sync.master_address``), by default at the address of rank 0's machine
that the engines reach (:func:`group_endpoint`). It is built once, through :func:`sync.group.init_group`'s controller-side
bound, and reused by every sync. The bodies are exactly vLLM 0.33.0's ``nccl`` ones (see
:mod:`engines.weight_transfer`)::

    POST /init_weight_transfer_engine {"init_info": {"master_address", "master_port",
        "rank_offset", "world_size", "packed", "packed_buffer_size_bytes",
        "packed_num_buffers"}}                                                once
    POST /start_weight_update         {}
    POST /update_weights              {"update_info": {"names", "dtype_names", "shapes"}}   per bucket
    POST /finish_weight_update        {"weight_version": "N"}    the engine applies the staged weights atomically

The engine's backend is the server's (vLLM: ``--weight-transfer-config '{"backend":
"nccl"}'``); nothing in the bodies names it. ``N`` is the trainer's weight version, as vLLM's
label (:func:`~sync.transports.base.finish_body`).

Rank 0 sends all of a sync's broadcasts in one call where it runs, while the
``/update_weights`` calls go out beside it (each engine receives an update's broadcasts
during its call). ``packed`` (vLLM's default): one ``/update_weights`` for the whole model,
as vLLM's trainer sends it, whose tensors travel in ``uint8`` chunks of about
``bucket_bytes`` cut as vLLM's consumer cuts them; on the CPU each chunk is a slice of rank
0's parameters, kept in one flat buffer (:mod:`sync.transports.flat_params`), so nothing is
copied; on a GPU the next chunk is packed into one of two reused buffers while the previous
one is on the wire. Unpacked: one ``/update_weights`` per bucket of at most
``bucket_bytes``, each parameter broadcast from its own storage. With gloo, rank 0's
collective waits are bounded by the step's remaining budget (``remaining()``) or, without
one, by ``timeout_s``; none of it holds the GIL while it waits or copies. With nccl they are
not bounded here: torch's ``ProcessGroupNCCL`` enforces a per-collective timeout through its
watchdog (which ends the process, not with a typed error), and vLLM's ``PyNcclCommunicator``
has none. What bounds an nccl transfer is ``sync.transfer_grace_s`` past the deadline, when
the run abandons it (``sync.transfer``); the communicator is not aborted then, the process's
exit ends it.

Both halves: the functions below marked "rank 0" run where rank 0 runs (through
``workers.run_on_rank0``); the engine side is ``engines/local/weight_routes.py``. The groups
a process joined as rank 0 are kept in that process, by name, until
:meth:`BroadcastTransport.close`. ``nccl`` needs CUDA where rank 0 runs and on the engines
(a CPU machine refuses it at init); it is built but not yet run on a GPU.
"""

from __future__ import annotations

import functools
import math
import uuid

import httpx
import trio

from engines.process_group import BACKSTOP_S, GroupBackend
from engines.types import ControlPlaneClient, EngineClient
from engines.weight_transfer import (
    nccl_init_info,
)
from sync.group import init_group
from sync.transports.base import Rank0, TransportSettings, finish_body, routes_of
from sync.transports.broadcast_rank0 import (
    GROUP,
    INIT_OP,
    group_endpoint,
    host_group,
    leave_group,
    plan_sync,
    send_buckets,
)
from sync.transports.buckets import update_bytes
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import open_owner_nursery, operation, remaining

__all__ = ["BroadcastTransport"]


class BroadcastTransport:
    """Rank 0 of the weight-sync group; ``init`` builds the group once, ``transfer`` reuses it.

    ``backend``: ``gloo`` (CPU) or ``nccl`` (GPU); the messages are the same. ``packed``:
    vLLM's wire param (the model in flat ``uint8`` chunks of about ``bucket_bytes``, which is
    also the ``packed_buffer_size_bytes`` sent).
    """

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> BroadcastTransport:
        """gloo or nccl (``settings.name``); rank 0 hosts the group at
        ``settings.master_address``, else at its address the engines reach."""
        backend: GroupBackend = "nccl" if settings.name == "nccl" else "gloo"
        return cls(
            settings.bucket_bytes,
            group_init_timeout_s=settings.group_init_timeout_s,
            timeout_s=settings.timeout_s,
            master_address=settings.master_address,
            backend=backend,
            packed=settings.packed,
        )

    def __init__(
        self,
        bucket_bytes: int,
        *,
        group_init_timeout_s: float,
        timeout_s: float = 1800.0,
        master_address: str | None = None,
        backend: GroupBackend = "gloo",
        packed: bool = True,
    ) -> None:
        self.bucket_bytes = bucket_bytes
        self.backend: GroupBackend = backend
        self.packed = packed
        self.group_init_timeout_s = group_init_timeout_s
        #: Bound of one collective when the step has no deadline (the group's own watchdog).
        self.timeout_s = timeout_s
        #: Where rank 0 hosts the group; None: rank 0's node address (see group_endpoint).
        self.master_address = master_address
        #: This transport's group, unique in rank 0's process.
        self.group_id = f"{GROUP}-{uuid.uuid4().hex[:8]}"
        self.initialized = False
        #: Tensor bytes of the last transfer (``sync/bytes``).
        self.last_bytes = 0
        #: Why this transport cannot send the weights again after a failed transfer (None:
        #: it can); ``sync.transfer`` reads it before a re-send.
        self.resend_refusal: str | None = None

    async def init(self, engine: EngineClient, workers: Rank0) -> None:
        """Build the group (policy rank 0, one rank per server) within ``group_init_timeout_s``.

        Raises ``CheckpointEngineInitError`` past the bound, or the first participant's own
        error (a server's 4xx, ``FaultInjected``) unchanged. Once built, a second call is a
        no-op.
        """
        if self.initialized:
            return
        routes = routes_of(engine)
        # one bound for the whole init: the engines' sizes, where rank 0 hosts, every join
        with operation(INIT_OP), trio.move_on_after(self.group_init_timeout_s) as scope:
            await self._build(routes, workers, list(routes.urls))
        if scope.cancelled_caught:
            raise CheckpointEngineInitError(GROUP, self.group_init_timeout_s)
        self.initialized = True

    async def _build(self, engine: ControlPlaneClient, workers: Rank0, urls: list[str]) -> None:
        """Rank 0's endpoint, then every participant's join (unbounded here: see ``init``).

        Every worker of an engine joins (a vLLM engine of tensor-parallel size N is N ranks,
        from its ``rank_offset``), so the group's size comes from each engine's
        ``/get_world_size``.
        """
        sizes = await engine.get_world_size()
        world_size = 1 + sum(sizes)
        offsets = [1 + sum(sizes[:i]) for i in range(len(urls))]
        # an engine in this process (inprocess://) is on this machine: no route to find
        hosts = [httpx.URL(url).host for url in urls if url.startswith(("http://", "https://"))]
        host, port = await workers.run_on_rank0(
            group_endpoint, self.master_address, hosts, abandon_on_cancel=True
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
                self.backend,
                abandon_on_cancel=True,
            )

        def server_join(i: int, url: str):
            init_info = nccl_init_info(
                master_address=host,
                master_port=port,
                rank_offset=offsets[i],
                world_size=world_size,
                packed=self.packed,
                packed_buffer_size_bytes=self.bucket_bytes,
            )

            async def join() -> None:
                # one server at a time: each has its own rank_offset
                await engine.control_one(
                    url, "POST", "/init_weight_transfer_engine", json={"init_info": init_info}
                )

            return join

        joins = [rank0_join, *(server_join(i, u) for i, u in enumerate(urls))]
        await init_group(GROUP, joins, timeout_s=math.inf)  # init() bounds the whole

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None:
        """One sync: rank 0 sends every bucket while the engines receive them, call by call."""
        if not self.initialized:
            raise RuntimeError("BroadcastTransport.transfer before init")
        routes = routes_of(engine)
        buckets = await workers.run_on_rank0(
            plan_sync, self.group_id, self.bucket_bytes, self.packed
        )
        self.last_bytes = update_bytes(buckets)
        await routes.control("POST", "/start_weight_update", json={})
        left = remaining()
        timeout_s = self.timeout_s if left is None else max(left, 0.001)
        send = functools.partial(
            workers.run_on_rank0,
            send_buckets,
            self.group_id,
            self.packed,
            timeout_s,
        )
        sent = False

        async def send_all() -> None:
            nonlocal sent
            await send()
            sent = True

        try:
            async with open_owner_nursery() as nursery:
                nursery.start_soon(send_all)
                for bucket in buckets:
                    await routes.control("POST", "/update_weights", json={"update_info": bucket})
        except BaseException:
            if not sent:  # its thread is given up on, maybe still inside a collective
                self.resend_refusal = (
                    "rank 0's broadcast was cut off mid-transfer, so the weight-sync group may "
                    "still carry its messages"
                )
            raise
        await routes.control("POST", "/finish_weight_update", json=finish_body(weight_version))

    async def close(self, workers: Rank0) -> None:
        """Rank 0 leaves the group (the engines' side ends with their servers)."""
        if self.initialized:
            self.initialized = False
            await workers.run_on_rank0(leave_group, self.group_id)
