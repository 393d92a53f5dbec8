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
    POST /finish_weight_update        {}    the engine applies the staged weights atomically

The engine's backend is the server's (vLLM: ``--weight-transfer-config '{"backend":
"nccl"}'``); nothing in the bodies names it.

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
the run abandons it (``sync.weights``); the communicator is not aborted then, the process's
exit ends it.

Both halves: the functions below marked "rank 0" run where rank 0 runs (through
``workers.run_on_rank0``); the engine side is ``engines/local/weight_routes.py``. The groups
a process joined as rank 0 are kept in that process, by name, until
:meth:`BroadcastTransport.close`. ``nccl`` needs CUDA where rank 0 runs and on the engines
(a CPU machine refuses it at init); it is built but not yet run on a GPU.
"""

from __future__ import annotations

import functools
import ipaddress
import math
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import attrs
import httpx
import torch
import trio

from engines.process_group import BACKSTOP_S, GroupBackend, GroupHandle, free_port, join_group
from engines.weight_transfer import (
    DEFAULT_PACKED_NUM_BUFFERS,
    nccl_init_info,
    packed_chunks,
    tensor_update_info,
)
from sync.group import init_group
from sync.transports.base import Rank0
from sync.transports.buckets import plan_buckets
from sync.transports.flat_params import (
    FlatParams,
    bucket_views,
    current_layout,
    flatten_parameters,
)
from trainer.errors import CheckpointEngineInitError
from trainer.vocabulary import open_owner_nursery, operation, remaining

__all__ = [
    "GROUP",
    "BroadcastTransport",
    "group_endpoint",
    "host_group",
    "hosted_groups",
    "leave_group",
    "plan_sync",
    "send_buckets",
]

#: The name errors and logs give the weight-sync group.
GROUP = "weight_sync"
INIT_OP = "init_process_group"


@attrs.define(eq=False)
class _Rank0State:
    """What rank 0's process keeps for one transport: its group, plan and pack buffers."""

    handle: GroupHandle
    #: This sync's broadcasts (packed: chunks; unpacked: buckets): parameter names, in order.
    plan: list[list[str]] = attrs.Factory(list)
    #: The two reused pack buffers (packed, parameters not flat), allocated when first needed.
    buffers: list[torch.Tensor] = attrs.Factory(list)
    #: Rank 0's parameters re-homed into one buffer (packed, CPU): chunks are its slices.
    flat: FlatParams | None = None


#: Rank 0's side of the groups this process joined, by group id.
_hosted: dict[str, _Rank0State] = {}


def group_endpoint(
    model: torch.nn.Module, host: str | None, engine_hosts: Sequence[str] = ()
) -> tuple[str, int]:
    """Rank 0: where it hosts the group's store, and a free port there.

    ``host`` None: this node's Ray address when Ray runs in rank 0's process (a Ray worker,
    or a trainer whose engines Ray placed); else the local address that routes to the first
    engine host that is not this machine's loopback; else loopback.
    """
    if host is None:
        import ray  # importing Ray costs seconds: only when no address was given

        if ray.is_initialized():
            host = str(ray.util.get_node_ip_address())
        else:
            remote = [h for h in engine_hosts if not is_loopback(h)]
            host = route_address(remote[0]) if remote else "127.0.0.1"
    return host, free_port(host)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def route_address(peer: str) -> str:
    """This machine's address on the route to ``peer`` (no packet is sent: a UDP socket's
    ``connect`` only picks the route)."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))
            return s.getsockname()[0]
    except OSError as exc:
        raise RuntimeError(
            f"cannot tell this machine's address toward the engine host {peer!r} ({exc}): "
            "set sync.master_address to an address of policy rank 0's machine the engines reach"
        ) from None


def host_group(
    model: torch.nn.Module,
    group_id: str,
    host: str,
    port: int,
    world_size: int,
    store_timeout_s: float,
    backend: GroupBackend = "gloo",
) -> None:
    """Rank 0: host and join the group (blocks until every rank joined or the store times out)."""
    _hosted[group_id] = _Rank0State(
        join_group(
            GROUP,
            master_address=host,
            master_port=port,
            rank=0,
            world_size=world_size,
            store_timeout_s=store_timeout_s,
            backend=backend,
        )
    )


def _state(group_id: str) -> _Rank0State:
    state = _hosted.get(group_id)
    if state is None:
        raise RuntimeError(f"a sync before rank 0 joined group {group_id!r}")
    return state


def plan_sync(
    model: torch.nn.Module, group_id: str, bucket_bytes: int, packed: bool = True
) -> list[dict[str, Any]]:
    """Rank 0: the ``update_info`` of each ``/update_weights`` call of one sync (and, kept
    here for :func:`send_buckets`, the parameters' names in each broadcast).

    Packed: one call for the whole model, as vLLM's trainer makes it; rank 0 broadcasts it
    in the chunks vLLM's consumer cuts (:func:`~engines.weight_transfer.packed_chunks` of
    ``bucket_bytes``: a chunk ends with the tensor that crosses the size), so the engine
    receives every chunk within that one call. Unpacked: one call per bucket of at most
    ``bucket_bytes`` (:func:`~sync.transports.buckets.plan_buckets`).
    """
    named = list(model.named_parameters())
    if packed:
        sizes = [p.numel() * p.element_size() for _, p in named]
        chunks = packed_chunks(sizes, bucket_bytes)
        _state(group_id).plan = [[named[i][0] for i in chunk] for chunk in chunks]
        return [tensor_update_info(named)]
    buckets = plan_buckets(named, bucket_bytes)
    _state(group_id).plan = [[name for name, _ in b] for b in buckets]
    return [tensor_update_info(b) for b in buckets]


def _flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


def send_buckets(model: torch.nn.Module, group_id: str, packed: bool, timeout_s: float) -> None:
    """Rank 0: broadcast what :func:`plan_sync` planned, in order (blocking).

    Packed: one broadcast per chunk, each a flat ``uint8`` buffer of its tensors' bytes. On
    the CPU the parameters are kept in one flat buffer (:mod:`sync.transports.flat_params`;
    re-homed at the first sync and whenever their storage changed) and each chunk goes out
    as its slice, no copy. Otherwise chunk ``k + 1`` is packed (one ``torch.cat`` into one
    of two buffers made once, as large as the largest chunk; GIL released) while chunk
    ``k`` is on the wire. Unpacked: each parameter from its own storage.
    """
    state = _state(group_id)
    handle = state.handle
    named = list(model.named_parameters())
    params = dict(named)
    device = handle.device if handle.device is not None else torch.device("cpu")
    with torch.no_grad():
        if not packed:
            for names in state.plan:
                works = [
                    handle.broadcast_async(params[n].detach(), 0, timeout_s=timeout_s)
                    for n in names
                ]
                for work in works:
                    if work is not None:
                        work.wait()
            return
        if handle.device is None:  # gloo: CPU tensors, sent from where they live
            if not current_layout(state.flat, named):
                state.flat = flatten_parameters(named)
            views = bucket_views(state.flat, state.plan) if state.flat is not None else None
            if views is not None:
                works = [handle.broadcast_async(v, 0, timeout_s=timeout_s) for v in views]
                for work in works:
                    if work is not None:
                        work.wait()
                return
        chunk_bytes = [sum(_nbytes(params[n]) for n in names) for names in state.plan]
        if not state.buffers or state.buffers[0].numel() < max(chunk_bytes):
            state.buffers = [
                torch.empty(max(chunk_bytes), dtype=torch.uint8, device=device)
                for _ in range(DEFAULT_PACKED_NUM_BUFFERS)
            ]
        pending: list[Any] = [None] * len(state.buffers)
        for k, (names, size) in enumerate(zip(state.plan, chunk_bytes)):
            slot = k % len(state.buffers)
            if pending[slot] is not None:
                pending[slot].wait()  # the slot's previous chunk has left
            pieces = [_flat_bytes(params[n]) for n in names]
            buf = state.buffers[slot]
            if buf.device == pieces[0].device:
                torch.cat(pieces, out=buf[:size])
            else:
                offset = 0
                for p in pieces:
                    buf[offset : offset + p.numel()].copy_(p, non_blocking=True)
                    offset += p.numel()
            pending[slot] = handle.broadcast_async(buf[:size], 0, timeout_s=timeout_s)
        for work in pending:
            if work is not None:
                work.wait()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def hosted_groups() -> dict[str, GroupHandle]:
    """The groups this process hosts as rank 0, by group id (a copy)."""
    return {k: v.handle for k, v in _hosted.items()}


def leave_group(model: torch.nn.Module, group_id: str) -> bool:
    """Rank 0: forget the group (its store closes with the handle); whether it was joined."""
    return _hosted.pop(group_id, None) is not None


class BroadcastTransport:
    """Rank 0 of the weight-sync group; ``init`` builds the group once, ``transfer`` reuses it.

    ``backend``: ``gloo`` (CPU) or ``nccl`` (GPU); the messages are the same. ``packed``:
    vLLM's wire param (the model in flat ``uint8`` chunks of about ``bucket_bytes``, which is
    also the ``packed_buffer_size_bytes`` sent).
    """

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
        #: Why this transport cannot send the weights again after a failed transfer (None:
        #: it can); ``sync.weights`` reads it before a re-send.
        self.resend_refusal: str | None = None

    async def init(self, engine: Any, workers: Rank0) -> None:
        """Build the group (policy rank 0, one rank per server) within ``group_init_timeout_s``.

        Raises ``CheckpointEngineInitError`` past the bound, or the first participant's own
        error (a server's 4xx, ``FaultInjected``) unchanged. Once built, a second call is a
        no-op.
        """
        if self.initialized:
            return
        # one bound for the whole init: the engines' sizes, where rank 0 hosts, every join
        with operation(INIT_OP), trio.move_on_after(self.group_init_timeout_s) as scope:
            await self._build(engine, workers, list(engine.urls))
        if scope.cancelled_caught:
            raise CheckpointEngineInitError(GROUP, self.group_init_timeout_s)
        self.initialized = True

    async def _build(self, engine: Any, workers: Rank0, urls: list[str]) -> None:
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

    async def transfer(self, engine: Any, workers: Rank0) -> None:
        """One sync: rank 0 sends every bucket while the engines receive them, call by call."""
        if not self.initialized:
            raise RuntimeError("BroadcastTransport.transfer before init")
        buckets = await workers.run_on_rank0(
            plan_sync, self.group_id, self.bucket_bytes, self.packed
        )
        await engine.control("POST", "/start_weight_update", json={})
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
                    await engine.control("POST", "/update_weights", json={"update_info": bucket})
        except BaseException:
            if not sent:  # its thread is given up on, maybe still inside a collective
                self.resend_refusal = (
                    "rank 0's broadcast was cut off mid-transfer, so the weight-sync group may "
                    "still carry its messages"
                )
            raise
        await engine.control("POST", "/finish_weight_update", json={})

    async def close(self, workers: Rank0) -> None:
        """Rank 0 leaves the group (the engines' side ends with their servers)."""
        if self.initialized:
            self.initialized = False
            await workers.run_on_rank0(leave_group, self.group_id)
