"""vLLM's weight-transfer messages (``nccl`` and ``ipc`` backends), built and parsed.

Both halves of a weight transport use this module: the trainer side (``sync.transports``)
builds the bodies, the reference engine (``engines.local``) parses them. The field lists
are vLLM 0.33.0's (``vllm/distributed/weight_transfer/``), pinned against a dump of that
source by ``tests/engines/test_weight_transfer_messages.py``:

- ``nccl`` ``init_info`` (``nccl_common.NCCLWeightTransferInitInfo``): ``master_address``,
  ``master_port``, ``rank_offset``, ``world_size``, ``nccl_unique_id_b64``, ``packed``,
  ``packed_buffer_size_bytes``, ``packed_num_buffers``; ``update_info``
  (``nccl_engine.NCCLWeightTransferUpdateInfo``): ``names``, ``dtype_names``, ``shapes``.
- ``ipc`` ``init_info`` (``ipc_engine.IPCWeightTransferInitInfo``): ``packed``;
  ``update_info`` (``ipc_engine.IPCWeightTransferUpdateInfo``): ``names``, ``dtype_names``,
  ``shapes``, ``ipc_handles``, ``ipc_handles_pickled``, ``tensor_sizes``.

vLLM picks the backend when the server starts (``--weight-transfer-config
'{"backend": "nccl"}'``); no ``init_info`` names it, and vLLM refuses a field it does not
know (``Invalid init_info``), as :func:`parse_info` does. The ``gloo`` stand-in sends the
``nccl`` bodies unchanged.

Packed transfers cut the parameters into chunks the way vLLM's consumer does
(``packed_tensor.packed_nccl_broadcast_consumer``): a chunk takes parameters until its byte
count *exceeds* ``packed_buffer_size_bytes`` (:func:`packed_chunks`), and travels as one
``uint8`` buffer.
"""

from __future__ import annotations

import base64
import io
import pickle
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = [
    "DEFAULT_PACKED_BUFFER_SIZE_BYTES",
    "DEFAULT_PACKED_NUM_BUFFERS",
    "IPC_INIT_FIELDS",
    "IPC_UPDATE_FIELDS",
    "NCCL_INIT_FIELDS",
    "NCCL_UPDATE_FIELDS",
    "dtype_name",
    "ipc_init_info",
    "ipc_update_info",
    "load_ipc_handles",
    "nccl_init_info",
    "packed_chunks",
    "parse_info",
    "pickle_ipc_handles",
    "tensor_update_info",
]

#: vLLM's ``packed_tensor.DEFAULT_PACKED_BUFFER_SIZE_BYTES`` (1 GiB).
DEFAULT_PACKED_BUFFER_SIZE_BYTES = 1024 * 1024 * 1024
#: vLLM's ``packed_tensor.DEFAULT_PACKED_NUM_BUFFERS``.
DEFAULT_PACKED_NUM_BUFFERS = 2

#: ``init_info`` of vLLM's ``nccl`` backend, and the type of each field.
NCCL_INIT_FIELDS: dict[str, tuple[type, ...]] = {
    "master_address": (str, type(None)),
    "master_port": (int, type(None)),
    "rank_offset": (int,),
    "world_size": (int,),
    "nccl_unique_id_b64": (str, type(None)),
    "packed": (bool,),
    "packed_buffer_size_bytes": (int,),
    "packed_num_buffers": (int,),
}
#: ``update_info`` of vLLM's ``nccl`` backend (empty lists: reuse the previous call's).
NCCL_UPDATE_FIELDS: dict[str, tuple[type, ...]] = {
    "names": (list,),
    "dtype_names": (list,),
    "shapes": (list,),
}
#: ``init_info`` of vLLM's ``ipc`` backend.
IPC_INIT_FIELDS: dict[str, tuple[type, ...]] = {"packed": (bool,)}
#: ``update_info`` of vLLM's ``ipc`` backend (over HTTP: ``ipc_handles_pickled``).
IPC_UPDATE_FIELDS: dict[str, tuple[type, ...]] = {
    "names": (list,),
    "dtype_names": (list,),
    "shapes": (list,),
    "ipc_handles": (list, dict, type(None)),
    "ipc_handles_pickled": (str, type(None)),
    "tensor_sizes": (list, type(None)),
}


def dtype_name(dtype: torch.dtype) -> str:
    """vLLM's ``dtype_names`` entry: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).split(".")[-1]


def nccl_init_info(
    *,
    master_address: str,
    master_port: int,
    rank_offset: int,
    world_size: int,
    packed: bool = True,
    packed_buffer_size_bytes: int = DEFAULT_PACKED_BUFFER_SIZE_BYTES,
    packed_num_buffers: int = DEFAULT_PACKED_NUM_BUFFERS,
) -> dict[str, object]:
    """The ``init_info`` vLLM's trainer helper sends for ``nccl`` (TCP rendezvous).

    As ``nccl_common.worker_init_payload`` writes it: the unset ``nccl_unique_id_b64`` is left
    out.
    """
    return {
        "master_address": master_address,
        "master_port": master_port,
        "rank_offset": rank_offset,
        "world_size": world_size,
        "packed": packed,
        "packed_buffer_size_bytes": packed_buffer_size_bytes,
        "packed_num_buffers": packed_num_buffers,
    }


def tensor_update_info(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """The ``nccl`` ``update_info`` of these tensors: ``names``, ``dtype_names``, ``shapes``."""
    pairs = list(named)
    return {
        "names": [n for n, _ in pairs],
        "dtype_names": [dtype_name(t.dtype) for _, t in pairs],
        "shapes": [list(t.shape) for _, t in pairs],
    }


def ipc_init_info(packed: bool) -> dict[str, object]:
    """The ``init_info`` vLLM's IPC trainer engine sends: ``{"packed": packed}``."""
    return {"packed": packed}


def ipc_update_info(
    named: Iterable[tuple[str, torch.Tensor]], tensor_sizes: list[int], ipc_handles_pickled: str
) -> dict[str, object]:
    """A packed ``ipc`` ``update_info`` as vLLM's HTTP client sends it (handles pickled)."""
    return {
        **tensor_update_info(named),
        "ipc_handles_pickled": ipc_handles_pickled,
        "tensor_sizes": tensor_sizes,
    }


def parse_info(
    info: object, fields: dict[str, tuple[type, ...]], what: str, required: Sequence[str] = ()
) -> dict[str, object]:
    """``info`` checked as vLLM's dataclass would take it: a dict of known fields, each of
    its type, the ``required`` ones present. Raises ``ValueError`` naming the first problem."""
    if not isinstance(info, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(info).__name__}")
    unknown = sorted(set(info) - set(fields))
    if unknown:
        raise ValueError(f"{what}: unknown field(s) {unknown}; vLLM takes {list(fields)}")
    missing = [k for k in required if k not in info]
    if missing:
        raise ValueError(f"{what}: missing field(s) {missing}")
    for key, value in info.items():
        kinds = fields[key]
        if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
            names = "/".join("null" if k is type(None) else k.__name__ for k in kinds)
            raise ValueError(f"{what}.{key} must be {names}, got {value!r:.80}")
    return info


def packed_chunks(sizes: Sequence[int], buffer_size_bytes: int) -> list[range]:
    """Indices of each packed chunk, cut as vLLM's consumer cuts them.

    A chunk takes entries until its byte count exceeds ``buffer_size_bytes`` (the entry
    that crosses it is the chunk's last); the rest is the final chunk.
    """
    chunks: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        total += size
        if total > buffer_size_bytes:
            chunks.append(range(start, i + 1))
            start, total = i + 1, 0
    if start < len(sizes):
        chunks.append(range(start, len(sizes)))
    return chunks


def pickle_ipc_handles(handles: object) -> str:
    """``ipc_handles_pickled``: base64 of the pickled handles (vLLM's HTTP client's encoding)."""
    return base64.b64encode(pickle.dumps(handles)).decode("utf-8")


#: What a CUDA IPC handle (``torch.multiprocessing.reductions.reduce_tensor``'s args) holds:
#: its storage class is the tensor's ``type(tensor._typed_storage())``, a ``TypedStorage``.
_HANDLE_GLOBALS = {
    ("torch._tensor", "Tensor"),
    ("torch", "Tensor"),
    ("torch.storage", "TypedStorage"),
    ("torch", "TypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch", "UntypedStorage"),
    ("torch", "Size"),
}


class _HandleUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _HANDLE_GLOBALS or isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"an IPC handle may not hold {module}.{name}")


def load_ipc_handles(pickled: str) -> Any:
    """Decode ``ipc_handles_pickled``, admitting only what an IPC handle holds (tensor and
    storage classes, ``torch.Size``, dtypes, builtins): no arbitrary objects are built.

    Raises ``ValueError`` for anything else. (vLLM itself unpickles freely, and only with
    ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``.)
    """
    try:
        return _HandleUnpickler(io.BytesIO(base64.b64decode(pickled, validate=True))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, TypeError, AttributeError) as exc:
        raise ValueError(f"ipc_handles_pickled: {exc}") from None
