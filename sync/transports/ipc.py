"""``sync.transport=ipc``: CUDA IPC to engines on the same GPU (vLLM's ``ipc`` backend).

Two processes cannot form an NCCL group on one GPU, so a trainer and an engine that share
it exchange memory instead. Rank 0 keeps one flat ``uint8`` buffer of ``bucket_bytes`` on
its GPU, allocated and exported (``reduce_tensor``) once at ``init`` and reused by
every sync: the engine maps the same handle once and copies out of it. The bodies are
exactly vLLM 0.33.0's packed ``ipc`` ones (see :mod:`engines.weight_transfer`)::

    POST /init_weight_transfer_engine {"init_info": {"packed": true}}                once
    POST /start_weight_update         {}
    POST /update_weights              {"update_info": {"names", "dtype_names", "shapes",
                                        "ipc_handles_pickled", "tensor_sizes"}}   per bucket
    POST /finish_weight_update        {"weight_version": "N"}

For each bucket rank 0 packs the parameters into the buffer (GPU copies, where rank 0
runs, off the trio thread), then the engines copy them out during their
``/update_weights`` call; the next bucket is packed only after every engine answered. The
extra GPU memory on the trainer is ``bucket_bytes`` (``sync.bucket_size_mb``).

A real vLLM server unpickles ``ipc_handles_pickled`` only with
``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (the reference server admits only what a handle
holds), and releases its mapping at each ``finish`` (it maps the handle again next sync).
GPU only: ``init`` raises ``RuntimeError`` where rank 0 sees no CUDA. Built, not yet run
on a GPU.
"""

from __future__ import annotations

import uuid

import attrs
import torch
import trio

from engines.process_group import require_cuda
from engines.types import EngineClient
from engines.weight_transfer import ipc_init_info, ipc_update_info, pickle_ipc_handles
from sync.transports.base import Rank0, TransportSettings, finish_body, routes_of
from sync.transports.buckets import plan_buckets

__all__ = ["IpcTransport", "ipc_plan", "pack_ipc_bucket", "release_ipc_buffer"]

#: How long releasing rank 0's buffer after a failed init may take.
RELEASE_TIMEOUT_S = 30.0


@attrs.define(eq=False)
class _IpcBuffer:
    """Rank 0's exported buffer and its handle (``ipc_handles_pickled``), made once."""

    buffer: torch.Tensor
    handle_pickled: str
    plan: list[list[str]] = attrs.Factory(list)


#: Rank 0's buffers in this process, by transport id.
_buffers: dict[str, _IpcBuffer] = {}


def _export(transport_id: str, bucket_bytes: int) -> _IpcBuffer:
    from torch.multiprocessing.reductions import reduce_tensor  # CUDA machines only

    device = require_cuda("sync.transport=ipc")
    buffer = torch.empty(bucket_bytes, dtype=torch.uint8, device=device)
    _, args = reduce_tensor(buffer)
    uuid_ = str(torch.cuda.get_device_properties(device).uuid)
    exported = _IpcBuffer(buffer, pickle_ipc_handles({uuid_: args}))
    _buffers[transport_id] = exported
    return exported


def ipc_plan(
    model: torch.nn.Module, transport_id: str, bucket_bytes: int
) -> list[dict[str, object]]:
    """Rank 0: the buckets of this sync; vLLM's packed ``update_info`` of each.

    Exports the buffer at the first call (``init``) (``RuntimeError`` without CUDA; ``ValueError`` for
    a parameter larger than ``bucket_bytes``, which could not travel).
    """
    exported = _buffers.get(transport_id) or _export(transport_id, bucket_bytes)
    infos, plan = [], []
    for bucket in plan_buckets(model.named_parameters(), bucket_bytes):
        sizes = [t.numel() * t.element_size() for _, t in bucket]
        if sum(sizes) > bucket_bytes:
            raise ValueError(
                f"parameter {bucket[0][0]!r} has {sum(sizes)} bytes, more than "
                f"sync.bucket_size_mb ({bucket_bytes} bytes): raise it"
            )
        plan.append([name for name, _ in bucket])
        infos.append(ipc_update_info(bucket, sizes, exported.handle_pickled))
    exported.plan = plan
    return infos


def pack_ipc_bucket(model: torch.nn.Module, transport_id: str, k: int) -> None:
    """Rank 0: copy bucket ``k``'s parameters into the buffer; returns once they landed."""
    exported = _buffers[transport_id]
    params = dict(model.named_parameters())
    offset = 0
    with torch.no_grad():
        for name in exported.plan[k]:
            flat = params[name].detach().contiguous().view(-1).view(torch.uint8)
            exported.buffer[offset : offset + flat.numel()].copy_(flat, non_blocking=True)
            offset += flat.numel()
    torch.cuda.current_stream(exported.buffer.device).synchronize()


def release_ipc_buffer(model: torch.nn.Module, transport_id: str) -> bool:
    """Rank 0: drop the buffer (freed once no engine maps it); whether there was one."""
    found = _buffers.pop(transport_id, None) is not None
    if found:
        torch.cuda.ipc_collect()
    return found


class IpcTransport:
    """vLLM's packed ``ipc`` backend from rank 0's GPU to engines on the same GPU."""

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> IpcTransport:
        return cls(settings.bucket_bytes)

    def __init__(self, bucket_bytes: int) -> None:
        self.bucket_bytes = bucket_bytes
        #: This transport's buffer, unique in rank 0's process.
        self.transport_id = f"ipc-{uuid.uuid4().hex[:8]}"
        self.initialized = False

    async def init(self, engine: EngineClient, workers: Rank0) -> None:
        """Export rank 0's buffer, then tell the engines the wire params (``packed``).

        Raises ``RuntimeError`` at once where rank 0 has no CUDA, and the engines' 400 where
        they have none.
        """
        routes = routes_of(engine)
        try:
            await workers.run_on_rank0(ipc_plan, self.transport_id, self.bucket_bytes)
            await routes.control(
                "POST", "/init_weight_transfer_engine", json={"init_info": ipc_init_info(True)}
            )
        except BaseException:
            # the buffer may be exported already (a refused init, an oversize parameter)
            with trio.move_on_after(RELEASE_TIMEOUT_S, shield=True):
                await workers.run_on_rank0(release_ipc_buffer, self.transport_id)
            raise
        self.initialized = True

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None:
        if not self.initialized:
            raise RuntimeError("IpcTransport.transfer before init")
        routes = routes_of(engine)
        buckets = await workers.run_on_rank0(ipc_plan, self.transport_id, self.bucket_bytes)
        await routes.control("POST", "/start_weight_update", json={})
        for k, bucket in enumerate(buckets):
            await workers.run_on_rank0(pack_ipc_bucket, self.transport_id, k)
            await routes.control("POST", "/update_weights", json={"update_info": bucket})
        await routes.control("POST", "/finish_weight_update", json=finish_body(weight_version))

    async def close(self, workers: Rank0) -> None:
        if self.initialized:
            self.initialized = False
            await workers.run_on_rank0(release_ipc_buffer, self.transport_id)
