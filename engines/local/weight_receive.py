"""How the reference server receives weights: a collective (``gloo``/``nccl``) or CUDA IPC.

Received tensors go into *staging buffers* that are allocated once and reused by every
sync (two pools: the one the model's parameters adopted at the last ``finish`` is never
written, so the engine keeps serving the old weights until the next ``finish``). Reusing
them spares the page faults of fresh memory each sync; adopting them (the parameters take
the staged tensors as their storage, :meth:`LocalEngine.load_weights` ``adopt=True``)
spares a copy of the whole model at ``finish``.

Every blocking part (the collective's wait, the IPC mapping and copies) runs in a thread;
none holds the trio thread. The ``nccl`` and ``ipc`` parts need CUDA and refuse at
``/init_weight_transfer_engine`` without it.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import Any

import attrs
import torch
import trio

from engines.local.engine import LocalEngine
from engines.local.protocol import ProtocolError
from engines.process_group import GroupHandle
from engines.weight_transfer import (
    IPC_UPDATE_FIELDS,
    NCCL_UPDATE_FIELDS,
    load_ipc_handles,
    packed_chunks,
    parse_info,
)

__all__ = ["StagingPools", "check_names", "receive_collective", "receive_ipc"]


@attrs.define(eq=False)
class StagingPools:
    """Two sets of reusable receive buffers, by key; one is written per sync."""

    #: The two pools: key -> buffer.
    pools: tuple[dict[Hashable, torch.Tensor], dict[Hashable, torch.Tensor]] = attrs.Factory(
        lambda: ({}, {})
    )
    #: The pool the parameters adopted at the last finish (never written); None: neither.
    live: int | None = None
    #: The pool this sync writes.
    current: int = 0

    def start(self) -> None:
        """A new sync writes the pool the parameters do not hold."""
        self.current = 1 if self.live == 0 else 0

    def adopted(self, adopted: bool) -> None:
        """``finish``: the parameters now hold this sync's pool (``adopted``) or copies."""
        self.live = self.current if adopted else None

    def buffer(
        self, key: Hashable, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """This sync's buffer ``key`` (reused when its shape, dtype and device still fit)."""
        pool = self.pools[self.current]
        buf = pool.get(key)
        if (
            buf is None
            or list(buf.shape) != list(shape)
            or buf.dtype != dtype
            or buf.device != torch.device(device)
        ):
            buf = pool[key] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return buf


def _announced(info: Any, fields: dict[str, tuple[type, ...]], required: Sequence[str] = ()):
    try:
        info = parse_info(info, fields, "update_info", required)
    except ValueError as exc:
        raise ProtocolError(400, str(exc), "update_info") from None
    names, dtypes, shapes = (info.get(k, []) for k in ("names", "dtype_names", "shapes"))
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ProtocolError(
            400, "update_info: names, dtype_names and shapes differ in length", "update_info"
        )
    torch_dtypes = []
    for dtype in dtypes:
        found = getattr(torch, str(dtype), None)
        if not isinstance(found, torch.dtype):
            raise ProtocolError(400, f"unknown dtype {dtype!r}", "dtype_names")
        torch_dtypes.append(found)
    try:
        shapes = [[int(d) for d in shape] for shape in shapes]
    except (TypeError, ValueError, OverflowError):
        raise ProtocolError(400, "update_info.shapes must be lists of ints", "shapes") from None
    return info, list(names), torch_dtypes, shapes


def check_names(engine: LocalEngine, names: list[Any], shapes: list[Any]) -> None:
    """400 unless every name is a parameter of the engine's model with that shape (a name
    that is not a string, a shape that is not a list of ints: 400 too)."""
    params = dict(engine.model.named_parameters())
    for name, shape in zip(names, shapes):
        if not isinstance(name, str):
            raise ProtocolError(400, f"update_info.names holds {name!r:.80}, not a string", "names")
        if not (isinstance(shape, list) and all(type(d) is int for d in shape)):
            raise ProtocolError(400, "update_info.shapes must be lists of ints", "shapes")
        if name not in params:
            raise ProtocolError(400, f"unknown parameter {name!r}", "names")
        if list(params[name].shape) != list(shape):
            raise ProtocolError(
                400,
                f"{name}: shape {list(shape)} does not match the model's {list(params[name].shape)}",
                "shapes",
            )


def _receive_all(group: GroupHandle, buffers: list[torch.Tensor]) -> None:
    """Blocking: receive every buffer from rank 0, in order (the broadcasts pipeline)."""
    works = [group.broadcast_async(buf, 0) for buf in buffers]
    for work in works:
        if work is not None:
            work.wait()


async def receive_collective(
    engine: LocalEngine,
    group: GroupHandle,
    pools: StagingPools,
    info: object,
    *,
    packed: bool,
    buffer_size_bytes: int,
    last: dict[str, object] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """Receive one ``nccl``-shaped ``update_info`` from rank 0's broadcasts; the staged
    tensors and the update's metadata (empty lists: ``last``'s, as vLLM reuses them).

    Packed: one ``uint8`` buffer per chunk (vLLM's cut); unpacked: one buffer per tensor.
    The receive comes before the name check, so a bad announcement still takes part in the
    collective and leaves the group in step with rank 0; the 400 follows.
    """
    update, names, dtypes, shapes = _announced(info, NCCL_UPDATE_FIELDS)
    if not names:
        if last is None:
            raise ProtocolError(400, "update_info: empty names with no earlier update", "names")
        update, names, dtypes, shapes = _announced(last, NCCL_UPDATE_FIELDS)
    device = group.device if group.device is not None else "cpu"
    sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
    if any(d < 0 for s in shapes for d in s) or sum(sizes) > _receive_bound(engine):
        # no buffer of that size is allocated: the announcement cannot be of this model
        raise ProtocolError(
            400, "update_info announces more bytes than this model's weights hold", "shapes"
        )
    out: dict[str, torch.Tensor] = {}
    if packed:
        buffers, pieces = [], []
        for chunk in packed_chunks(sizes, buffer_size_bytes):
            key = ("chunk", names[chunk[0]], len(chunk))
            buf = pools.buffer(key, [sum(sizes[i] for i in chunk)], torch.uint8, device)
            buffers.append(buf)
            pieces.extend(zip(chunk, buf.split([sizes[i] for i in chunk])))
        await trio.to_thread.run_sync(_receive_all, group, buffers)
        for i, piece in pieces:
            out[names[i]] = piece.view(dtypes[i]).view(shapes[i])
    else:
        for name, dtype, shape in zip(names, dtypes, shapes):
            out[name] = pools.buffer(name, shape, dtype, device)
        await trio.to_thread.run_sync(_receive_all, group, list(out.values()))
    check_names(engine, names, shapes)
    return out, update


def _receive_bound(engine: LocalEngine) -> int:
    """The most bytes one update may announce: the model's parameters, in the widest dtype
    a sender may use (8 bytes an element), once over."""
    return 8 * sum(p.numel() for p in engine.model.parameters())


#: A CUDA IPC handle's args: index of the device index (vLLM overwrites it with the receiver's).
_DEVICE_ARG = 6


def _map_and_copy(
    handles: Any,
    names: list[str],
    dtypes: list[torch.dtype],
    shapes: list[list[int]],
    tensor_sizes: list[int] | None,
    targets: list[torch.Tensor],
    mapped: dict[tuple, torch.Tensor],
) -> None:
    """Blocking (CUDA): map the trainer's buffers (once per handle) and copy out of them."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor  # CUDA machines only

    index = torch.cuda.current_device()
    uuid = str(torch.cuda.get_device_properties(index).uuid)

    def open_handle(handle: dict[str, Any]) -> torch.Tensor:
        if uuid not in handle:
            raise ProtocolError(
                400, f"no IPC handle for this GPU ({uuid}); got {list(handle)}", "ipc_handles"
            )
        args = list(handle[uuid])
        args[_DEVICE_ARG] = index
        key = tuple(args)
        if key not in mapped:
            mapped.clear()  # a new export replaces the old mapping (released once)
            mapped[key] = rebuild_cuda_tensor(*args)
        return mapped[key]

    if tensor_sizes is not None:
        packed = open_handle(handles)[: sum(tensor_sizes)]
        sources = [
            piece.view(dtype).view(shape)
            for piece, dtype, shape in zip(packed.split(tensor_sizes), dtypes, shapes)
        ]
    else:
        sources = [open_handle(h) for h in handles]
    for target, source in zip(targets, sources):
        target.copy_(source, non_blocking=True)
    torch.cuda.current_stream().synchronize()


async def receive_ipc(
    engine: LocalEngine,
    pools: StagingPools,
    info: object,
    *,
    packed: bool,
    mapped: dict[tuple, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Copy one ``ipc`` ``update_info``'s tensors out of the trainer's CUDA IPC buffers.

    Packed: ``ipc_handles`` (or ``ipc_handles_pickled``) is one ``{gpu_uuid: args}`` for the
    trainer's flat buffer, cut by ``tensor_sizes``; unpacked: one such dict per tensor. The
    mapping is kept while the trainer sends the same handle (mapped once, reused by every
    sync).
    """
    update, names, dtypes, shapes = _announced(
        info, IPC_UPDATE_FIELDS, ("names", "dtype_names", "shapes")
    )
    check_names(engine, names, shapes)
    handles = update.get("ipc_handles")
    if update.get("ipc_handles_pickled") is not None:
        if handles is not None:
            raise ProtocolError(
                400, "give ipc_handles or ipc_handles_pickled, not both", "ipc_handles"
            )
        try:
            handles = load_ipc_handles(update["ipc_handles_pickled"])
        except ValueError as exc:
            raise ProtocolError(400, str(exc), "ipc_handles_pickled") from None
    if handles is None:
        raise ProtocolError(
            400, "update_info needs ipc_handles or ipc_handles_pickled", "ipc_handles"
        )
    tensor_sizes = update.get("tensor_sizes")
    if packed and (not isinstance(handles, dict) or tensor_sizes is None):
        raise ProtocolError(
            400, "packed ipc needs one handle dict and tensor_sizes", "tensor_sizes"
        )
    if not packed and not (isinstance(handles, list) and len(handles) == len(names)):
        raise ProtocolError(400, "unpacked ipc needs one handle dict per name", "ipc_handles")
    device = next(engine.model.parameters()).device
    targets = [pools.buffer(n, s, d, device) for n, s, d in zip(names, shapes, dtypes)]
    await trio.to_thread.run_sync(
        _map_and_copy,
        handles,
        names,
        dtypes,
        shapes,
        tensor_sizes if packed else None,
        targets,
        mapped,
    )
    return dict(zip(names, targets))
