"""``sync.transport=gloo|nccl``, rank 0's side: where the weight-sync group is hosted
(:func:`group_endpoint`), the group rank 0 hosts and keeps by id in its process
(:func:`host_group`, :func:`hosted_groups`, :func:`leave_group`), each sync's plan
(:func:`plan_sync`) and its broadcasts (:func:`send_buckets`). Each runs where rank 0 runs,
through ``workers.run_on_rank0``; :class:`sync.transports.broadcast.BroadcastTransport` is
the trainer's side."""

from __future__ import annotations

import ipaddress
import socket
import sys
from collections.abc import Sequence
from typing import Any

import attrs
import torch

from engines.process_group import GroupBackend, GroupHandle, free_port, join_group
from engines.weight_transfer import (
    DEFAULT_PACKED_NUM_BUFFERS,
    packed_chunks,
    tensor_update_info,
)
from sync.transports.buckets import plan_buckets
from sync.transports.flat_params import (
    FlatParams,
    bucket_views,
    current_layout,
    flatten_parameters,
)

__all__ = [
    "GROUP",
    "group_endpoint",
    "host_group",
    "hosted_groups",
    "is_loopback",
    "leave_group",
    "plan_sync",
    "route_address",
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

    ``host`` None: this node's Ray address when rank 0 is a Ray actor (the engines may be on
    any node); else (rank 0 in the trainer's own process, with or without a Ray driver in it)
    the local address that routes to the first engine host that is not this machine's
    loopback (Ray-placed engines: this node's address); else loopback.
    """
    if host is None:
        if _in_ray_actor():
            import ray

            host = str(ray.util.get_node_ip_address())
        else:
            remote = [h for h in engine_hosts if not is_loopback(h)]
            host = route_address(remote[0]) if remote else "127.0.0.1"
    return host, free_port(host)


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor (Ray is imported only where it already is: an actor
    has it loaded, and importing it costs seconds)."""
    ray = sys.modules.get("ray")
    if ray is None or not ray.is_initialized():
        return False
    return ray.get_runtime_context().get_actor_id() is not None


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
) -> list[dict[str, object]]:
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
