"""The worker-group interface the step loop drives, whatever runs the workers.

Every method is awaited from the trio thread and names its operation (DESIGN 4.3), so a
deadline that expires while the driver waits reports it. Only the driver's wait is
interrupted: a worker stuck in a method keeps running, and ``shutdown`` (bounded) is how
the trainer gets rid of it. Implementations: ``LocalWorkerGroup`` (threads in this
process) and ``RayWorkerGroup`` (Ray actors, data parallel).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import SaveCheckpoint
from trainer.workers.batch import TrainBatch

__all__ = ["WorkerGroup"]

T = TypeVar("T")


class WorkerGroup(Protocol):
    async def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Policy logprobs of each next token (operation ``forward``)."""
        ...

    async def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        """Reference logprobs (operation ``forward``); None without a reference model."""
        ...

    async def forward_backward(self, batch: TrainBatch, counts: BatchCounts) -> dict[str, float]:
        """Accumulate gradients over ``batch`` (operation ``forward_backward``), normalized by
        ``counts``: those of the whole mini-batch ``batch`` is (part of)."""
        ...

    async def optim_step(self) -> dict[str, float]:
        """Apply accumulated gradients (operation ``optim_step``)."""
        ...

    async def compute_values(self, batch: TrainBatch) -> torch.Tensor | None:
        """The critic's value of each position (operation ``critic_forward``); None without a
        critic."""
        ...

    async def critic_forward_backward(
        self, batch: TrainBatch, counts: BatchCounts
    ) -> dict[str, float]:
        """Accumulate the critic's gradients over ``batch`` (operation
        ``critic_forward_backward``), normalized by the whole mini-batch's ``counts``."""
        ...

    async def critic_optim_step(self) -> dict[str, float]:
        """Apply the critic's accumulated gradients (operation ``critic_optim_step``)."""
        ...

    async def offload_to_cpu(self) -> dict[str, float]:
        """Free the policy's device memory for a colocated engine (operation
        ``offload_to_cpu``); ``workers/offload_bytes``, 0 where nothing moves (the CPU)."""
        ...

    async def backload_to_gpu(self) -> dict[str, float]:
        """Bring the offloaded policy back (operation ``backload_to_gpu``);
        ``workers/backload_bytes``."""
        ...

    async def run_on_rank0(
        self, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False
    ) -> T:
        """``fn(policy_model, *args)`` where policy rank 0 runs; its result.

        The one way a weight transport reaches rank 0 (it owns what runs there): a thread
        of this process for local workers, rank 0's actor for Ray workers, so ``fn`` must be
        a module-level function and its arguments picklable. The current step travels
        with the call (faults fire on the right step). Not abandoned by default: a
        cancellation waits for ``fn`` to return (DESIGN 3 rule 6, a transfer never
        half-done); ``abandon_on_cancel=True`` lets a bounded wait give up on it.
        """
        ...

    async def save_checkpoint(
        self, save: SaveCheckpoint, step: int, trainer_state: dict[str, object]
    ) -> Path:
        """Write checkpoint ``step`` through ``save`` (``CheckpointManager.save``, which makes
        it atomic), handing it the writer of the policy's files and the critic's (operation
        ``save_checkpoint``)."""
        ...

    async def load_checkpoint(self, directory: Path) -> None: ...

    async def shutdown(self) -> None:
        """Stop every worker; bounded, safe to call after a worker hung."""
        ...
