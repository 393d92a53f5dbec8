"""The weight-transfer routes of the reference server (vLLM's four-phase protocol).

``/init_weight_transfer_engine`` once, then per sync ``/start_weight_update``, one
``/update_weights`` per bucket, ``/finish_weight_update``. The reference engine implements two
backends:

- ``disk``: each ``update_info`` names a safetensors file (vLLM's ``names``, ``dtype_names``
  and ``shapes``, plus ``path``) that the server reads in a thread and stages;
- ``gloo``: ``init_info`` is vLLM's NCCL shape (``master_address``, ``master_port``,
  ``rank_offset``, ``world_size``) plus ``backend: "gloo"``; the server joins the group as
  rank ``rank_offset`` in a thread (the call answers once joined), and each ``update_info``
  (no ``path``) is received from rank 0's broadcast as one flat buffer, in a thread, into a
  fresh buffer that is staged.

``finish`` applies everything staged in one step, between two decode steps, so no request
ever samples from half-updated weights. Until ``finish`` the engine serves the old weights.
A new ``start`` discards a staged update that was never finished (an interrupted sync).
"""

from __future__ import annotations

import functools
import logging
import math
from typing import Any

import attrs
import torch
import trio
from safetensors.torch import load_file

from engines.local.engine import EngineAsleepError, LocalEngine
from engines.local.http import Request, Response, json_response
from engines.local.protocol import ProtocolError, parse_json_object
from engines.process_group import join_group

__all__ = ["WEIGHT_TRANSFER_PATHS", "WeightReceiver", "handle_weight_transfer"]

log = logging.getLogger(__name__)

WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
BACKENDS = ("disk", "gloo")


@attrs.define(eq=False)
class WeightReceiver:
    """Per-server state of the protocol: which backend, and the update being staged.

    One per server, owned by the server app (``ServerApp.weight_receiver``).
    """

    #: ``disk`` or ``gloo`` once ``/init_weight_transfer_engine`` succeeded; None before.
    backend: str | None = None
    #: The weight-sync group (backend ``gloo``), joined once.
    group: Any = None
    #: Tensors received since ``/start_weight_update``; None outside an update.
    staged: dict[str, torch.Tensor] | None = None
    #: Updates applied by ``/finish_weight_update`` so far.
    updates_finished: int = 0


async def handle_weight_transfer(
    engine: LocalEngine, rx: WeightReceiver, request: Request
) -> Response:
    """Answer one of :data:`WEIGHT_TRANSFER_PATHS` (POST only) for ``engine``, whose
    protocol state is ``rx``. Bad input raises ``ProtocolError`` (a 4xx)."""
    if request.method != "POST":
        raise ProtocolError(405, f"{request.path} accepts POST only")
    body = parse_json_object(request.body) if request.body.strip() else {}
    if request.path == "/init_weight_transfer_engine":
        info = body.get("init_info", {})
        backend = info.get("backend", "disk") if isinstance(info, dict) else None
        if backend not in BACKENDS:
            raise ProtocolError(
                400,
                f"init_info.backend must be one of {', '.join(BACKENDS)}, got {backend!r}",
                "init_info",
            )
        if backend == "gloo":
            assert isinstance(info, dict)
            rx.group = await _join_group(info)
        rx.backend = backend
        return json_response({"backend": backend})
    if rx.backend is None:
        raise ProtocolError(409, "call /init_weight_transfer_engine first")
    if request.path == "/start_weight_update":
        if rx.staged is not None:
            log.warning("a weight update was started and never finished: discarding it")
        rx.staged = {}
        return json_response({})
    if rx.staged is None:
        raise ProtocolError(
            409, f"{request.path} outside an update: call /start_weight_update first"
        )
    if request.path == "/update_weights":
        info = body.get("update_info")
        if not isinstance(info, dict):
            raise ProtocolError(400, "the body needs an 'update_info' object", "update_info")
        if rx.backend == "gloo":
            bucket = await _receive_bucket(engine, rx.group, info)
        else:
            bucket = await _read_bucket(engine, info)
        rx.staged.update(bucket)
        return json_response({"staged": len(rx.staged)})
    staged, rx.staged = rx.staged, None
    try:
        await engine.load_weights(staged)
    except EngineAsleepError as exc:
        raise ProtocolError(409, f"{exc} before finishing a weight update") from None
    rx.updates_finished += 1
    return json_response({"weight_version": engine.weight_version, "loaded": len(staged)})


async def _join_group(info: dict[str, Any]) -> Any:
    try:
        address = str(info["master_address"])
        port, rank, world_size = (
            int(info[k]) for k in ("master_port", "rank_offset", "world_size")
        )
        timeout_s = float(info.get("group_timeout_s", 1800.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(
            400,
            "init_info needs master_address, master_port, rank_offset and world_size "
            f"({type(exc).__name__}: {exc})",
            "init_info",
        ) from None
    if not 0 < rank < world_size:
        raise ProtocolError(400, f"rank_offset {rank} is not in [1, {world_size})", "init_info")
    # The trainer bounds the init on its side (sync.group_init_timeout_s) and tears this
    # server down if it expires; the store's own timeout only ends an abandoned join.
    return await trio.to_thread.run_sync(
        functools.partial(
            join_group,
            "weight_sync",
            master_address=address,
            master_port=port,
            rank=rank,
            world_size=world_size,
            store_timeout_s=timeout_s,
        ),
        abandon_on_cancel=True,
    )


def _announced(info: dict[str, Any]) -> tuple[list[Any], list[Any], list[Any]]:
    names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ProtocolError(
            400, "update_info needs lists 'names', 'dtype_names' and 'shapes'", "update_info"
        )
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ProtocolError(
            400, "update_info: names, dtype_names and shapes differ in length", "update_info"
        )
    return names, dtypes, shapes


async def _receive_bucket(
    engine: LocalEngine, group: Any, info: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Receive one bucket from rank 0's broadcast (one flat buffer), then check and split it.

    The receive comes first, so a bad announcement still takes part in the collective and
    leaves the group in step with rank 0; the 400 follows.
    """
    names, dtypes, shapes = _announced(info)
    if len(set(dtypes)) != 1 or not isinstance(getattr(torch, str(dtypes[0]), None), torch.dtype):
        raise ProtocolError(400, f"a bucket holds one known dtype, got {dtypes}", "dtype_names")
    dtype = getattr(torch, str(dtypes[0]))
    try:
        numels = [math.prod(int(d) for d in shape) for shape in shapes]
    except (TypeError, ValueError):
        raise ProtocolError(400, "update_info.shapes must be lists of ints", "shapes") from None
    flat = torch.empty(sum(numels), dtype=dtype)
    await trio.to_thread.run_sync(group.broadcast, flat)
    _check_names(engine, names, dtypes, shapes)
    out: dict[str, torch.Tensor] = {}
    for name, piece, shape in zip(names, flat.split(numels), shapes):
        out[name] = piece.view(shape)
    return out


def _check_names(
    engine: LocalEngine, names: list[Any], dtypes: list[Any], shapes: list[Any]
) -> None:
    params = dict(engine.model.named_parameters())
    for name, dtype, shape in zip(names, dtypes, shapes):
        if name not in params:
            raise ProtocolError(400, f"unknown parameter {name!r}", "names")
        if list(params[name].shape) != shape:
            raise ProtocolError(
                400,
                f"{name}: shape {shape} does not match the model's {list(params[name].shape)}",
                "shapes",
            )
        if not hasattr(torch, str(dtype)):
            raise ProtocolError(400, f"{name}: unknown dtype {dtype!r}", "dtype_names")


async def _read_bucket(engine: LocalEngine, info: dict[str, Any]) -> dict[str, torch.Tensor]:
    names, dtypes, shapes = _announced(info)
    path = info.get("path")
    if not isinstance(path, str):
        raise ProtocolError(
            400, "update_info.path (a safetensors file) is required by the disk backend", "path"
        )
    _check_names(engine, names, dtypes, shapes)
    try:
        tensors = await trio.to_thread.run_sync(load_file, path)
    except (OSError, ValueError, RuntimeError) as exc:  # missing file, corrupt header
        raise ProtocolError(400, f"cannot read {path}: {exc}", "path") from None
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ProtocolError(400, f"{path} lacks {missing[0]!r} announced in names", "path")
    for name, shape in zip(names, shapes):
        if list(tensors[name].shape) != shape:
            raise ProtocolError(
                400,
                f"{path}: {name} has shape {list(tensors[name].shape)}, announced {shape}",
                "path",
            )
    return {n: tensors[n] for n in names}
