"""What runs inside a Ray actor: a policy (or reference) worker plus its data-parallel rank.

The actor process knows nothing of trio. Each call names its operation and carries the
driver's step explicitly (contextvars do not cross processes) so a fault fires here, where
the operation really runs: a ``hang`` really blocks this actor.

Data parallelism: every rank holds the full model; the driver gives each rank its shard of
a batch together with the *global* token count, so each rank's loss is its share of the
global token mean and the sum of the ranks' gradients (an all-reduce SUM in ``optim_step``)
is exactly the single-worker gradient of the whole batch. After the all-reduce every rank
clips and steps the same gradient, so weights stay identical across ranks.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
import torch.distributed as dist

from engines.process_group import free_port
from trainer.checkpoint import CheckpointManager
from trainer.vocabulary import at_step, fire_fault_sync
from trainer.workers.batch import TrainBatch
from trainer.workers.policy import PolicyWorker, RefWorker

__all__ = ["PolicyActor", "RefActor"]

T = TypeVar("T")


class _Actor:
    def pid(self) -> int:
        return os.getpid()

    def fire(self, op: str, step: int | None) -> None:
        fire_fault_sync(op, step)


class RefActor(_Actor):
    """A frozen reference model (one per run; it computes logprobs only)."""

    def __init__(self, model_dir: str, temperature: float, micro_batch_size: int | None) -> None:
        torch.set_num_threads(1)
        self.worker = RefWorker(
            model_dir, temperature=temperature, micro_batch_size=micro_batch_size
        )

    def compute_logprobs(self, op: str, step: int | None, batch: TrainBatch) -> torch.Tensor:
        self.fire(op, step)
        return self.worker.compute_logprobs(batch)


class PolicyActor(_Actor):
    """One data-parallel rank of the policy."""

    def __init__(
        self, model_dir: str, rank: int, world_size: int, policy_kwargs: dict[str, Any]
    ) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        self._reduced = False
        self.worker = PolicyWorker(model_dir, **policy_kwargs)

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port for the group's TCP store (rank 0 is asked)."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def init_group(self, host: str, port: int, timeout_s: float) -> None:
        """Join the data-parallel group: gloo on CPU, NCCL on GPU (a collective; all ranks)."""
        if self.world_size == 1:
            return
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )

    def compute_logprobs(self, op: str, step: int | None, batch: TrainBatch) -> torch.Tensor:
        self.fire(op, step)
        return self.worker.compute_logprobs(batch)

    def forward_backward(
        self, op: str, step: int | None, batch: TrainBatch | None, num_tokens: int
    ) -> dict[str, float]:
        """Accumulate this shard's gradients (``batch`` None: this rank has no rows)."""
        self.fire(op, step)
        if batch is None or len(batch) == 0:
            return {}
        return self.worker.forward_backward(batch, num_tokens)

    def reduce_gradients(self) -> torch.Tensor:
        """Sum the ranks' gradients in place (once per optimizer step; a collective).

        Returns the flat reduced gradient (tests compare it with a single worker's).
        """
        params = [p for p in self.worker.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank with no rows this mini-batch
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        if self.world_size > 1 and not self._reduced:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        self._reduced = True
        return flat

    def optim_step(self, op: str, step: int | None) -> dict[str, float]:
        """All-reduce (sum) the gradients, then clip and step like a single worker."""
        self.fire(op, step)
        self.reduce_gradients()
        self._reduced = False
        return self.worker.optim_step()

    def offload_to_cpu(self, op: str, step: int | None) -> None:
        self.fire(op, step)
        self.worker.offload_to_cpu()

    def backload_to_gpu(self, op: str, step: int | None) -> None:
        self.fire(op, step)
        self.worker.backload_to_gpu()

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], step: int | None) -> T:
        """``fn(model, *args)`` at the driver's ``step`` (``RayWorkerGroup.run_on_rank0``)."""
        with at_step(step):
            return fn(self.worker.model, *args)

    def save_checkpoint(
        self,
        op: str,
        step: int | None,
        ckpt: CheckpointManager,
        global_step: int,
        trainer_state: dict[str, Any],
    ) -> Path:
        self.fire(op, step)
        return ckpt.save(global_step, self.worker.save_checkpoint, trainer_state)

    def load_checkpoint(self, directory: str) -> None:
        self.worker.load_checkpoint(Path(directory))

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
