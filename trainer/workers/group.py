"""The worker-group interface the step loop drives, whatever runs the workers.

Every method is awaited from the trio thread and names its operation (DESIGN 4.3), so a
deadline that expires while the driver waits reports it. Only the driver's wait is
interrupted: a worker stuck in a method keeps running, and ``shutdown`` (bounded) is how
the trainer gets rid of it. Implementations: ``LocalWorkerGroup`` (threads in this
process) and ``RayWorkerGroup`` (Ray actors, data parallel).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.checkpoint import CheckpointManager
from trainer.workers.batch import TrainBatch

__all__ = ["WorkerGroup"]


class WorkerGroup(Protocol):
    async def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Policy logprobs of each next token (operation ``forward``)."""
        ...

    async def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Reference logprobs (operation ``forward``); None without a reference model."""
        ...

    async def forward_backward(self, batch: TrainBatch, num_tokens: int) -> dict[str, float]:
        """Accumulate gradients over ``batch`` (operation ``forward_backward``)."""
        ...

    async def optim_step(self) -> dict[str, float]:
        """Apply accumulated gradients (operation ``optim_step``)."""
        ...

    async def offload_to_cpu(self) -> None: ...

    async def backload_to_gpu(self) -> None: ...

    async def named_weights(self) -> dict[str, torch.Tensor]:
        """Rank 0's weights, for a weight sync to the engines."""
        ...

    async def export_weights(self, directory: Path, bucket_bytes: int) -> list[dict[str, Any]]:
        """Rank 0's weights as safetensors buckets under ``directory``; one update_info each."""
        ...

    async def weight_buckets(self, bucket_bytes: int) -> list[dict[str, Any]]:
        """Rank 0's vLLM ``update_info`` per bucket (``sync.transport=broadcast``)."""
        ...

    async def weight_sync_endpoint(self, host: str) -> tuple[str, int]:
        """Where rank 0 hosts the weight-sync group's store: ``host`` when rank 0 is in
        this process, rank 0's node address otherwise; and a free port there."""
        ...

    def join_weight_sync(
        self, name: str, host: str, port: int, world_size: int, store_timeout_s: float
    ) -> Callable[[], Awaitable[None]]:
        """Start rank 0's join of the weight-sync group now; return the wait for it (which
        :func:`sync.group.init_group` bounds). The group is kept for ``broadcast_bucket``."""
        ...

    async def broadcast_bucket(self, names: list[str], timeout_s: float) -> None:
        """Broadcast the named parameters as one flat buffer from rank 0 (bounded by
        ``timeout_s``)."""
        ...

    async def save_checkpoint(
        self, ckpt: CheckpointManager, step: int, trainer_state: dict[str, Any]
    ) -> Path:
        """Write checkpoint ``step`` atomically through ``ckpt`` (operation ``save_checkpoint``)."""
        ...

    async def load_checkpoint(self, directory: Path) -> None: ...

    async def shutdown(self) -> None:
        """Stop every worker; bounded, safe to call after a worker hung."""
        ...
