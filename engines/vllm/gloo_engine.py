"""vLLM's ``nccl`` weight-transfer protocol over a gloo group: real vLLM takes weights on the CPU.

Started by ``--weight-transfer-config '{"backend": "gloo"}'`` once the project is installed in
vLLM's environment (the entry point registers it: :mod:`engines.vllm`). The trainer's sender
(``sync.transport=gloo``, :mod:`sync.transports.broadcast`) is unchanged: it speaks to this
engine exactly as to the reference server (``engines/local/weight_receive.py``).

- ``init_info`` and ``update_info`` are vLLM's ``nccl`` ones (``NCCLWeightTransferInitInfo``,
  ``NCCLWeightTransferUpdateInfo``), parsed by vLLM's own dataclasses.
- The group is :func:`engines.process_group.join_group`'s (a ``TCPStore`` that policy rank 0
  hosts, a ``ProcessGroupGloo`` over it, prefix ``weight_sync/``); this worker's rank is
  vLLM's own reckoning (``rank_offset`` + data-parallel index x world size + its rank).
- Packed (the trainer's default): each chunk is one ``uint8`` broadcast cut as vLLM's
  consumer cuts it (:func:`engines.weight_transfer.packed_chunks`), unpacked into views and
  handed to the model's ``load_weights``; unpacked: one broadcast per tensor.
- Start and finish are the ``nccl`` engine's: vLLM's layerwise reload, and after the finish a
  tied LM head prepared again (:mod:`engines.vllm.tied_head`). A failed update leaves the
  layers half-loaded (vLLM's behaviour, not this engine's).
- No CUDA call: ``update_weights`` is overridden because the base ends it with
  ``torch.accelerator.synchronize()`` ("Cannot access accelerator device" on the CPU).
- ``master_address`` must be one of ``TRAINER_WEIGHT_SYNC_HOSTS`` (comma-separated; unset:
  loopback only), checked before anything connects (:mod:`engines.weight_access`).
- Bounded: the store and every collective time out after
  ``TRAINER_WEIGHT_TRANSFER_TIMEOUT_S`` (default 1800 s, the reference server's bound); the
  trainer bounds the init and each sync on its side and ends the server when they expire.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict

import torch
from vllm.distributed.weight_transfer.nccl_engine import (
    NCCLWeightTransferEngine,
    NCCLWeightTransferInitInfo,
    NCCLWeightTransferUpdateInfo,
)

from engines.process_group import GroupHandle, join_group
from engines.vllm.cpu_sampling import mend_cpu_seeded_rewind
from engines.vllm.tied_head import refresh_tied_heads
from engines.weight_access import SYNC_HOSTS_ENV, check_master_address, sync_hosts_from_env
from engines.weight_transfer import packed_chunks

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "GlooWeightTransferEngine"]

#: Environment variable: the bound, in seconds, of the group's store and each collective.
TIMEOUT_ENV = "TRAINER_WEIGHT_TRANSFER_TIMEOUT_S"
#: Its default (the reference server's ``DEFAULT_STORE_TIMEOUT_S``).
DEFAULT_TIMEOUT_S = 1800.0
#: The group's name: the store prefix the trainer's rank 0 uses (``sync.transports.broadcast``).
GROUP = "weight_sync"


def _timeout_s() -> float:
    return float(os.environ.get(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's ``nccl`` engine with a gloo group and CPU buffers (see the module docstring)."""

    init_info_cls = NCCLWeightTransferInitInfo
    update_info_cls = NCCLWeightTransferUpdateInfo

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        mend_cpu_seeded_rewind()  # vLLM constructs this in its worker: engines.vllm.cpu_sampling
        #: This worker's membership in the trainer's group; None before init.
        self.handle: GroupHandle | None = None
        #: The previous update's metadata (an update with empty lists reuses it).
        self.last: NCCLWeightTransferUpdateInfo | None = None

    def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
        """Join the trainer's gloo group (blocks until every rank joined or the bound)."""
        if init_info.master_address is None or init_info.master_port is None:
            raise ValueError(
                "the gloo weight-transfer engine needs master_address and master_port "
                "(nccl_unique_id_b64 is NCCL's)"
            )
        check_master_address(
            init_info.master_address, sync_hosts_from_env(), setting=SYNC_HOSTS_ENV
        )
        pc = self.parallel_config
        rank = pc.data_parallel_index * pc.world_size + pc.rank + init_info.rank_offset
        if not 0 < rank < init_info.world_size:
            raise ValueError(f"rank {rank} is not in [1, {init_info.world_size})")
        self.packed = init_info.packed
        self.packed_buffer_size_bytes = init_info.packed_buffer_size_bytes
        self.packed_num_buffers = init_info.packed_num_buffers
        self.handle = join_group(
            GROUP,
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank=rank,
            world_size=init_info.world_size,
            store_timeout_s=_timeout_s(),
        )

    def finish_weight_update(self) -> None:
        """vLLM's finish (the layerwise reload finalised), then a tied LM head prepared again
        where vLLM's CPU build would keep it stale (:mod:`engines.vllm.tied_head`)."""
        super().finish_weight_update()
        refresh_tied_heads(self.model)

    def update_weights(self, update_info: dict[str, object]) -> None:
        """The base's, without its ``torch.accelerator.synchronize()`` (CPU: nothing to wait
        for once the gloo broadcasts returned)."""
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: NCCLWeightTransferUpdateInfo) -> None:
        """Receive one update from rank 0's broadcasts and load it into the model."""
        if self.handle is None:
            raise RuntimeError("gloo weight transfer not initialized: init_weight_transfer_engine")
        if not update_info.names:
            if self.last is None:
                raise ValueError("update_info: empty names with no earlier update")
            update_info = self.last
        self.last = NCCLWeightTransferUpdateInfo(**asdict(update_info))
        names = list(update_info.names)
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        shapes = [[int(x) for x in s] for s in update_info.shapes]
        timeout_s = _timeout_s()
        load = self.model.load_weights
        if not self.packed:
            for name, dtype, shape in zip(names, dtypes, shapes):
                weight = torch.empty(shape, dtype=dtype)
                self.handle.broadcast(weight, 0, timeout_s=timeout_s)
                load([(name, weight)])
            return
        sizes = [math.prod(s) * d.itemsize for s, d in zip(shapes, dtypes)]
        chunks = packed_chunks(sizes, self.packed_buffer_size_bytes)
        # every chunk's receive is posted at once (gloo pipelines them, as rank 0 sends them)
        buffers = [torch.empty(sum(sizes[i] for i in c), dtype=torch.uint8) for c in chunks]
        works = [self.handle.broadcast_async(b, 0, timeout_s=timeout_s) for b in buffers]
        for chunk, buf, work in zip(chunks, buffers, works):
            if work is not None:
                work.wait()
            pieces = buf.split([sizes[i] for i in chunk])
            load(
                [
                    (names[i], piece.view(dtypes[i]).view(shapes[i]))
                    for i, piece in zip(chunk, pieces)
                ]
            )

    def shutdown(self) -> None:
        """Leave the group (its store closes with the handle)."""
        self.handle = None
