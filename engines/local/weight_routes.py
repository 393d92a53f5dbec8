"""The weight-transfer routes of the reference server (vLLM's four-phase protocol).

``/init_weight_transfer_engine`` once, then per sync ``/start_weight_update``, one
``/update_weights`` per bucket, ``/finish_weight_update``. The server's backend is fixed at
start-up, as vLLM's is (``serve --weight-transfer-config '{"backend": "gloo"}'``), or, left
unset, chosen by the first ``init_info``: vLLM's ``nccl`` shape (``master_address`` ...)
means ``nccl`` when the model is on a GPU, else ``gloo``; vLLM's ``ipc`` shape
(``{"packed": ...}``) means ``ipc``; ``{"backend": "disk"}`` means ``disk``.

- ``gloo`` (CPU; vLLM's ``nccl`` messages over gloo) and ``nccl`` (GPU): ``init_info`` and
  ``update_info`` are exactly vLLM's ``nccl`` bodies (see :mod:`engines.weight_transfer`);
  the server joins the group as rank ``rank_offset`` in a thread (the call answers once
  joined), and each ``update_info`` is received from rank 0's broadcasts (packed chunks cut
  as vLLM cuts them, or one tensor at a time), in a thread;
- ``ipc`` (GPU, same device as the trainer): vLLM's ``ipc`` bodies; the server maps the
  trainer's CUDA IPC buffer once and copies out of it;
- ``disk`` (this project's; in real vLLM, the plugin's :mod:`engines.vllm.disk_engine`): ``init_info`` is ``{"backend":
  "disk"}`` and each ``update_info`` names a safetensors file (vLLM's ``names``,
  ``dtype_names`` and ``shapes``, plus ``path``) that the server reads in a thread.

The update follows real vLLM 0.32's session, which loads the layers as their weights arrive
(its layerwise reload), where the trainer relies on it:

- ``start`` opens an update and leaves the weights *partial* (``LocalEngine.weights_partial``)
  until a ``finish`` of that update succeeds; a decode step due meanwhile kills the engine
  (vLLM's worker crashes there) and the server exits;
- ``start`` while an update is open is refused; a tensor sent twice in one update fails;
- a failed ``update`` closes the update and leaves the weights partial: ``finish`` is then
  refused, and only a new complete start, update(s), finish makes the engine whole;
- a ``finish`` of an open update with tensors missing keeps their previous values (vLLM keeps
  a layer that received nothing; a half-received layer is undefined there);
- the engine-side failures of these routes answer as vLLM's do: 500, ``Call to
  collective_rpc method failed: Worker failed with error '...'``; a body that is not the
  route's shape is a 400 (vLLM's worker fails on some of these too, a 500 there: the reference
  keeps its promise that bad input is never a 5xx), and so is an ``nccl`` or ``ipc`` init on
  a machine without CUDA;
- what a body may name is the run's (:mod:`engines.weight_access`): a ``disk`` update reads
  only regular files under the server's ``--weight-dir`` (403 otherwise, the same words whether
  or not the file exists; no folder: disk is refused at init), and a group's
  ``master_address`` must be one of ``--weight-sync-hosts`` (400, before any connection).

What the reference does in its own way (docs/engines.md, "Where the reference engine differs
from vLLM"): it stages the tensors and loads them at ``finish``, between two decode steps (so
a finished update is never seen half-applied); it needs ``/init_weight_transfer_engine``
before a ``start`` (vLLM's engine exists from start-up); ``finish``'s ``weight_version``
(vLLM's label of the weights, a string) becomes the engine's ``weight_version``, a number, so a
label that is not a whole number is refused (:func:`finish_version`), and a finish without one
counts one more. ``nccl`` and ``ipc`` need CUDA: on a machine without it their init is refused.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import trio

from engines.local.engine import LocalEngine
from engines.local.http import Request, Response, json_response
from engines.local.protocol import ProtocolError, parse_json_object
from engines.local.requests import EngineAsleepError
from engines.local.weight_receive import StagingPools, check_names, receive_collective, receive_ipc
from engines.process_group import GroupHandle, join_group, require_cuda
from engines.weight_access import (
    LOOPBACK_HOSTS,
    WeightAccessError,
    check_master_address,
    load_weight_file,
    require_weight_dir,
)
from engines.weight_transfer import (
    DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    IPC_INIT_FIELDS,
    NCCL_INIT_FIELDS,
    parse_info,
)
from trainer.vocabulary import FaultAction, fire_fault, sampler_skew

__all__ = [
    "BACKENDS",
    "DEFAULT_STORE_TIMEOUT_S",
    "SYNC_HOSTS_SETTING",
    "WEIGHT_DIR_SETTING",
    "WEIGHT_TRANSFER_PATHS",
    "WeightReceiver",
    "finish_version",
    "handle_weight_transfer",
]

log = logging.getLogger(__name__)

WEIGHT_TRANSFER_PATHS = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)
#: The backends the reference server implements (``nccl`` and ``ipc`` on CUDA only).
BACKENDS = ("gloo", "nccl", "ipc", "disk")
#: The server's own bound on its group's store and collectives (``serve
#: --weight-transfer-timeout-s``); the trainer bounds the init and each sync on its side.
DEFAULT_STORE_TIMEOUT_S = 1800.0
#: How the reference server's refusals name the settings of :mod:`engines.weight_access`.
WEIGHT_DIR_SETTING = "--weight-dir (or TRAINER_WEIGHT_DIR)"
SYNC_HOSTS_SETTING = "--weight-sync-hosts (or TRAINER_WEIGHT_SYNC_HOSTS)"
#: The largest port a ``master_port`` may name.
_MAX_PORT = 65535


@attrs.define(eq=False)
class WeightReceiver:
    """Per-server state of the protocol: which backend, and the update being staged.

    One per server, owned by the server app (``ServerApp.weight_receiver``).
    """

    #: The backend fixed at start-up (``--weight-transfer-config``); None: by the first init.
    configured: str | None = None
    #: Bound of the group's store and collectives, in seconds.
    store_timeout_s: float = DEFAULT_STORE_TIMEOUT_S
    #: The only folder a ``disk`` update may read files from (``--weight-dir``); None: the
    #: ``disk`` backend is refused.
    weight_dir: str | None = None
    #: The addresses an ``init_info.master_address`` may name (``--weight-sync-hosts``).
    sync_hosts: frozenset[str] = LOOPBACK_HOSTS
    #: One of :data:`BACKENDS` once ``/init_weight_transfer_engine`` succeeded; None before.
    backend: str | None = None
    #: The weight-sync group (``gloo``/``nccl``), joined once.
    group: GroupHandle | None = None
    #: vLLM's must-agree wire params, from ``init_info``.
    packed: bool = False
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES
    #: The last non-empty ``nccl`` ``update_info`` (an empty one reuses it, as in vLLM).
    last_update: dict[str, object] | None = None
    #: Reused receive buffers (see :mod:`engines.local.weight_receive`).
    pools: StagingPools = attrs.Factory(StagingPools)
    #: The trainer's IPC buffer, mapped once (``ipc``).
    ipc_mapped: dict[tuple, torch.Tensor] = attrs.Factory(dict)
    #: Tensors received since ``/start_weight_update``; None outside an open update.
    staged: dict[str, torch.Tensor] | None = None
    #: Updates applied by ``/finish_weight_update`` so far.
    updates_finished: int = 0


def _choose_backend(engine: LocalEngine, rx: WeightReceiver, info: dict[str, Any]) -> str:
    if "backend" in info:  # this project's disk backend names itself
        if info["backend"] != "disk" or len(info) != 1:
            raise ProtocolError(
                400,
                "init_info names no backend in vLLM's protocol (the server's "
                "--weight-transfer-config does); only {'backend': 'disk'} may",
                "init_info",
            )
        return "disk"
    if rx.configured is not None:
        return rx.configured
    if set(info) & {"master_address", "rank_offset", "nccl_unique_id_b64"}:
        on_gpu = next(engine.model.parameters()).device.type == "cuda"
        return "nccl" if on_gpu else "gloo"
    return "ipc"


async def _init(engine: LocalEngine, rx: WeightReceiver, info: dict[str, Any]) -> None:
    """Set the backend up; a body it cannot take (shape, address, no CUDA, no weight folder)
    is a 400 or 403 :class:`ProtocolError`, a failure to join the group a ``RuntimeError``."""
    backend = _choose_backend(engine, rx, info)
    if backend in ("gloo", "nccl"):
        address, port, rank, world_size = _group_fields(info, backend, rx.sync_hosts)
        if backend == "nccl":
            _needs_cuda(backend, "the nccl weight-transfer backend")
        rx.group = await _join_group(address, port, rank, world_size, backend, rx.store_timeout_s)
        rx.packed = bool(info.get("packed", False))
        rx.packed_buffer_size_bytes = int(
            info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
        )
    elif backend == "ipc":
        _parse(info, IPC_INIT_FIELDS, backend)
        _needs_cuda(backend, "the ipc weight-transfer backend")
        rx.packed = bool(info.get("packed", False))
    else:
        try:
            require_weight_dir(rx.weight_dir, setting=WEIGHT_DIR_SETTING)
        except WeightAccessError as exc:
            raise ProtocolError(400, exc.message, "init_info") from None
    rx.backend = backend


def _parse(
    info: dict[str, Any],
    fields: dict[str, tuple[type, ...]],
    backend: str,
    required: tuple[str, ...] = (),
) -> None:
    try:
        parse_info(info, fields, "init_info", required)
    except ValueError as exc:
        raise ProtocolError(400, f"{backend}: {exc}", "init_info") from None


def _needs_cuda(backend: str, what: str) -> None:
    try:
        require_cuda(what)
    except RuntimeError as exc:
        raise ProtocolError(400, f"{backend}: {exc}", "init_info") from None


def _group_fields(
    info: dict[str, Any], backend: str, sync_hosts: frozenset[str]
) -> tuple[str, int, int, int]:
    """An ``nccl``-shaped ``init_info``'s address, port, rank and world size, each checked
    (400) before anything connects: the address must be one of ``sync_hosts``."""
    _parse(info, NCCL_INIT_FIELDS, backend, ("rank_offset", "world_size"))
    address, port = info.get("master_address"), info.get("master_port")
    if address is None or port is None:
        raise ProtocolError(
            400,
            f"{backend}: init_info needs master_address and master_port (the reference server "
            "does not take nccl_unique_id_b64)",
            "init_info",
        )
    try:
        check_master_address(address, sync_hosts, setting=SYNC_HOSTS_SETTING)
    except WeightAccessError as exc:
        raise ProtocolError(400, f"{backend}: {exc.message}", "master_address") from None
    rank, world_size = int(info["rank_offset"]), int(info["world_size"])
    if not 0 < rank < world_size:
        raise ProtocolError(
            400, f"{backend}: rank_offset {rank} is not in [1, {world_size})", "rank_offset"
        )
    if not 0 < int(port) <= _MAX_PORT:
        raise ProtocolError(400, f"{backend}: master_port {port} is not a port", "master_port")
    size = info.get("packed_buffer_size_bytes", DEFAULT_PACKED_BUFFER_SIZE_BYTES)
    if int(size) <= 0:
        raise ProtocolError(
            400, f"{backend}: packed_buffer_size_bytes must be positive", "init_info"
        )
    return str(address), int(port), rank, world_size


#: vLLM's answers when a weight-update call comes out of turn (its worker's words).
NOT_STARTED = "start_weight_update must be called before update_weights."
NOT_STARTED_FINISH = "finish_weight_update called without a matching start_weight_update."
ALREADY_ACTIVE = (
    "start_weight_update called while a weight update is already active. "
    "Call finish_weight_update first."
)


def worker_failed(message: str) -> ProtocolError:
    """vLLM's answer when a weight route's call fails in its worker: a 500 in this frame."""
    return ProtocolError(
        500,
        f"Call to collective_rpc method failed: Worker failed with error '{message}', "
        "please check the stack trace above for the root cause",
    )


async def handle_weight_transfer(
    engine: LocalEngine, rx: WeightReceiver, request: Request
) -> Response:
    """Answer one of :data:`WEIGHT_TRANSFER_PATHS` (POST only) for ``engine``, whose
    protocol state is ``rx``. A body of the wrong shape raises a 400 ``ProtocolError``; a
    failure of the call itself, vLLM's 500 (:func:`worker_failed`)."""
    if request.method != "POST":
        raise ProtocolError(405, f"{request.path} accepts POST only")
    body = parse_json_object(request.body) if request.body.strip() else {}
    if request.path == "/update_weights" and not isinstance(body.get("update_info"), dict):
        raise ProtocolError(400, "the body needs an 'update_info' object", "update_info")
    if request.path == "/init_weight_transfer_engine" and not isinstance(
        body.get("init_info", {}), dict
    ):
        raise ProtocolError(400, "init_info must be a JSON object", "init_info")
    if request.path == "/finish_weight_update":
        finish_version(body)  # a label it cannot take is refused before the update is touched
    try:
        await fire_fault(request.path, request.step)  # TRAINER_FAULTS: a failure of the call
        await _call(engine, rx, request.path, body, request.step)
    except Exception as exc:
        if request.path == "/update_weights":
            rx.staged = None  # vLLM closes the update; its weights stay partial
            engine.end_update(whole=False)
        if isinstance(exc, ProtocolError) and exc.status < 500:
            log.warning("%s refused: %s", request.path, exc.message)
            raise  # the body, not the call: no 5xx for bad input
        message = exc.message if isinstance(exc, ProtocolError) else f"{exc}"
        log.warning("%s failed: %s", request.path, message)
        raise worker_failed(message) from None
    return json_response({"message": _DONE[request.path]})


_DONE = {
    "/init_weight_transfer_engine": "Weight transfer initialized",
    "/start_weight_update": "Weight update started",
    "/update_weights": "Weights updated",
    "/finish_weight_update": "Weight update finished",
}


async def _call(
    engine: LocalEngine, rx: WeightReceiver, path: str, body: dict[str, Any], step: int | None
) -> None:
    """Do ``path``'s work. The sampler-skewing faults (``TRAINER_FAULTS``) act here, silently:
    ``/update_weights:drop_bucket`` receives the bucket and leaves it out of the update,
    ``/finish_weight_update:stale`` finishes it (the new version named) on the old weights."""
    if path == "/init_weight_transfer_engine":
        await _init(engine, rx, body.get("init_info", {}))
    elif path == "/start_weight_update":
        if rx.backend is None:
            raise ValueError("Weight transfer not initialized: call /init_weight_transfer_engine")
        if rx.staged is not None:
            raise ValueError(ALREADY_ACTIVE)
        rx.staged = {}
        rx.pools.start()
        engine.begin_update(f"update {rx.updates_finished + 1} was started and not finished")
    elif path == "/update_weights":
        if rx.staged is None:
            raise ValueError(NOT_STARTED)
        bucket = await _receive(engine, rx, body["update_info"])
        again = next((n for n in bucket if n in rx.staged), None)
        if again is not None:
            raise ValueError(f"{again} was already loaded in this update")
        if sampler_skew(path, step) is FaultAction.DROP_BUCKET:
            log.warning("fault drop_bucket: %d tensor(s) acknowledged, not applied", len(bucket))
            return
        rx.staged.update(bucket)
    else:
        if rx.staged is None:
            raise ValueError(NOT_STARTED_FINISH)
        if sampler_skew(path, step) is FaultAction.STALE:
            log.warning("fault stale: the update is acknowledged, the old weights serve on")
            version = finish_version(body)
            engine.weight_version = engine.weight_version + 1 if version is None else version
            rx.staged = None  # the pools stay as they were: the parameters hold what they held
            engine.end_update(whole=True)
            rx.updates_finished += 1
            return
        try:
            adopted = await engine.load_weights(
                rx.staged, adopt=rx.backend != "disk", weight_version=finish_version(body)
            )
        except EngineAsleepError as exc:
            raise ValueError(f"{exc} before finishing a weight update") from None
        rx.staged = None
        engine.end_update(whole=True)
        rx.pools.adopted(adopted)
        rx.updates_finished += 1


def finish_version(body: Mapping[str, object]) -> int | None:
    """The version a ``/finish_weight_update`` names: vLLM's ``weight_version`` label (a string
    or null; vLLM answers 422 to anything else), which the reference engine takes as its
    ``weight_version`` where it is a whole number (the trainer sends its count of syncs);
    None where the body names none (the engine counts one more). Another label is a 400:
    the reference engine's versions are numbers (docs/engines.md)."""
    label = body.get("weight_version")
    if label is None:
        return None
    if not isinstance(label, str):
        raise ProtocolError(
            400, f"weight_version must be a string or null, got {label!r}", "weight_version"
        )
    if not (label.isascii() and label.isdigit()):
        raise ProtocolError(
            400,
            f"weight_version={label!r}: the reference engine labels its weights with whole "
            "numbers (the trainer's weight version)",
            "weight_version",
        )
    return int(label)


async def _receive(
    engine: LocalEngine, rx: WeightReceiver, info: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """One ``update_info``'s tensors, by the backend's channel."""
    if rx.backend in ("gloo", "nccl"):
        assert rx.group is not None  # joined by the init that set the backend
        bucket, rx.last_update = await receive_collective(
            engine,
            rx.group,
            rx.pools,
            info,
            packed=rx.packed,
            buffer_size_bytes=rx.packed_buffer_size_bytes,
            last=rx.last_update,
        )
        return bucket
    if rx.backend == "ipc":
        return await receive_ipc(engine, rx.pools, info, packed=rx.packed, mapped=rx.ipc_mapped)
    return await _read_bucket(engine, info, rx.weight_dir)


async def _join_group(
    address: str, port: int, rank: int, world_size: int, backend: str, store_timeout_s: float
) -> GroupHandle:
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
            store_timeout_s=store_timeout_s,
            backend=backend,  # type: ignore[arg-type]
        ),
        abandon_on_cancel=True,
    )


async def _read_bucket(
    engine: LocalEngine, info: dict[str, object], weight_dir: str | None
) -> dict[str, torch.Tensor]:
    """A ``disk`` update's tensors. A body of the wrong shape is a 400 and a path the server
    may not read a 403 (:mod:`engines.weight_access`); a file that is missing, unreadable or
    not what the body announced fails the call (``ValueError``: vLLM's 500)."""
    names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)):
        raise ProtocolError(
            400, "update_info needs lists 'names', 'dtype_names' and 'shapes'", "update_info"
        )
    if not len(names) == len(dtypes) == len(shapes):
        raise ProtocolError(
            400, "update_info: names, dtype_names and shapes differ in length", "update_info"
        )
    path = info.get("path")
    if not isinstance(path, str):
        raise ProtocolError(
            400, "update_info.path (a safetensors file) is required by the disk backend", "path"
        )
    check_names(engine, names, shapes)
    for dtype in dtypes:
        if not isinstance(getattr(torch, str(dtype), None), torch.dtype):
            raise ProtocolError(400, f"unknown dtype {dtype!r}", "dtype_names")
    try:
        tensors = await trio.to_thread.run_sync(
            functools.partial(load_weight_file, path, weight_dir, setting=WEIGHT_DIR_SETTING)
        )
    except WeightAccessError as exc:
        if exc.forbidden:
            raise ProtocolError(403, exc.message, "path") from None
        raise ValueError(exc.message) from None
    missing = [n for n in names if n not in tensors]
    if missing:
        raise ValueError(f"{path} lacks {missing[0]!r} announced in names")
    for name, shape in zip(names, shapes):
        if list(tensors[name].shape) != shape:
            raise ValueError(
                f"{path}: {name} has shape {list(tensors[name].shape)}, announced {shape}"
            )
    return {n: tensors[n] for n in names}
