"""What runs inside a Ray actor: a policy (or reference) worker plus its data-parallel rank,
and, in a run with a critic, the critic's rank beside the policy's (one process, one group).

The actor process knows nothing of trio. Each call names its operation and carries the
driver's step explicitly (contextvars do not cross processes) so a fault fires here, where
the operation really runs: a ``hang`` really blocks this actor.

Data parallelism: the driver gives each rank its shard of a batch together with the
*global* token count, so each rank's loss is its share of the global token mean and the sum
of the ranks' gradients is exactly the single-worker gradient of the whole batch. Two ways
(``workers.data_parallel``, decided by the run plan: ``auto`` shards on CUDA):

- replicate: every rank holds the full model; ``optim_step`` all-reduces (SUM) the
  gradients, then every rank clips and steps the same gradient, so weights stay identical;
- fsdp2: the model is sharded with FSDP2 (:mod:`trainer.workers.fsdp`),
  gradients are reduce-scattered (summed) in the backward pass, each rank steps its shard.
  Reading the weights (``run``) gathers them, a collective every rank joins
  (``gather_weights`` on the others). Checkpoints of a sharded policy are not supported yet.

The group's backend follows the model's device (:func:`trainer.workers.device.collective_backend`):
NCCL for CUDA tensors, gloo for CPU ones.
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

from engines.process_group import free_port, tcp_store
from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import SaveCheckpoint
from trainer.errors import WorkerError
from trainer.vocabulary import at_step, fire_fault_sync
from trainer.workers.batch import TrainBatch
from trainer.workers.critic import CriticWorker
from trainer.workers.device import collective_backend
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

    def __init__(
        self,
        model_dir: str,
        temperature: float,
        micro_batch_size: int | None,
        device: str = "auto",
        dtype: str = "auto",
        micro_batch_max_tokens: int | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.worker = RefWorker(
            model_dir,
            temperature=temperature,
            micro_batch_size=micro_batch_size,
            micro_batch_max_tokens=micro_batch_max_tokens,
            device=device,
            dtype=dtype,
        )

    def compute_logprobs(self, op: str, step: int | None, batch: TrainBatch) -> torch.Tensor:
        self.fire(op, step)
        return self.worker.compute_logprobs(batch)


class PolicyActor(_Actor):
    """One data-parallel rank of the policy."""

    def __init__(
        self,
        model_dir: str,
        rank: int,
        world_size: int,
        policy_kwargs: dict[str, Any],
        sharded: bool = False,
        critic_kwargs: dict[str, Any] | None = None,
    ) -> None:
        torch.set_num_threads(1)
        self.rank = rank
        self.world_size = world_size
        #: Whether the models are to be FSDP2-sharded (the run plan's decision); they are
        #: once ``init_group`` has formed the group (never at world size 1).
        self.to_shard = sharded
        self.sharded = False
        #: The models whose gradients this optimizer step has summed over the ranks.
        self._reduced: set[str] = set()
        self.worker = PolicyWorker(model_dir, **policy_kwargs)
        self.critic = None if critic_kwargs is None else CriticWorker(**critic_kwargs)

    def master_address(self) -> tuple[str, int]:
        """This node's address and a free port for the group's TCP store (rank 0 is asked)."""
        host = ray.util.get_node_ip_address()
        return host, free_port(host)

    def init_group(self, host: str, port: int, timeout_s: float) -> bool:
        """Join the data-parallel group (a collective; all ranks): NCCL when the model is on
        CUDA, gloo on the CPU. Shards the model with FSDP2 when the plan says so. Returns
        whether it did; never at world size 1."""
        if self.world_size == 1:
            return False
        device = self.worker.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(
            collective_backend(device),
            # rank 0's store on this node's address alone (a tcp:// rendezvous listens on
            # every interface)
            store=tcp_store(host, port, self.world_size, self.rank, timeout),
            rank=self.rank,
            world_size=self.world_size,
            timeout=timeout,
        )
        if self.to_shard:
            self.worker.shard()
            if self.critic is not None:
                self.critic.shard()
            self.sharded = True
        return self.sharded

    def compute_logprobs(self, op: str, step: int | None, batch: TrainBatch) -> torch.Tensor:
        self.fire(op, step)
        return self.worker.compute_logprobs(batch)

    def forward_backward(
        self, op: str, step: int | None, batch: TrainBatch | None, counts: BatchCounts
    ) -> dict[str, float]:
        """Accumulate this shard's gradients (``batch`` None: this rank has no rows)."""
        self.fire(op, step)
        if batch is None or len(batch) == 0:
            return {}
        return self.worker.forward_backward(batch, counts)

    def reduce_gradients(self, model: str = "policy") -> torch.Tensor:
        """Sum the ranks' gradients of ``model`` (``policy`` or ``critic``) in place (once per
        optimizer step; a collective).

        Returns the flat reduced gradient on the CPU (tests compare it with a single
        worker's). Sharded, FSDP2 already summed them: the full gradient is gathered.
        """
        module = self.worker.model if model == "policy" else self._critic().model
        params = [p for p in module.parameters() if p.requires_grad]
        if self.sharded:
            self._reduced.add(model)
            full = [p.grad.full_tensor() for p in params]  # type: ignore[union-attr]
            return torch.cat([g.reshape(-1) for g in full]).cpu()
        for p in params:
            if p.grad is None:  # a rank with no rows this mini-batch
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
        if self.world_size > 1 and model not in self._reduced:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in params:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n
        self._reduced.add(model)
        return flat.cpu()

    def optim_step(self, op: str, step: int | None) -> dict[str, float]:
        """All-reduce (sum) the gradients unless FSDP2 did, then clip and step."""
        self.fire(op, step)
        if not self.sharded:
            self.reduce_gradients("policy")
        self._reduced.discard("policy")
        return self.worker.optim_step()

    def _critic(self) -> CriticWorker:
        if self.critic is None:
            raise RuntimeError("this policy rank holds no critic (the run trains none)")
        return self.critic

    def compute_values(self, op: str, step: int | None, batch: TrainBatch) -> torch.Tensor:
        self.fire(op, step)
        return self._critic().compute_values(batch)

    def critic_forward_backward(
        self, op: str, step: int | None, batch: TrainBatch | None, counts: BatchCounts
    ) -> dict[str, float]:
        """Accumulate this shard's critic gradients (``batch`` None: this rank has no rows)."""
        self.fire(op, step)
        if batch is None or len(batch) == 0:
            return {}
        return self._critic().forward_backward(batch, counts)

    def critic_optim_step(self, op: str, step: int | None) -> dict[str, float]:
        """The critic's step, as :meth:`optim_step` the policy's."""
        self.fire(op, step)
        if not self.sharded:
            self.reduce_gradients("critic")
        self._reduced.discard("critic")
        return self._critic().optim_step()

    def offload_to_cpu(self, op: str, step: int | None) -> dict[str, float]:
        self.fire(op, step)
        return self.worker.offload_to_cpu()

    def backload_to_gpu(self, op: str, step: int | None) -> dict[str, float]:
        self.fire(op, step)
        return self.worker.backload_to_gpu()

    def run(self, fn: Callable[..., T], args: tuple[Any, ...], step: int | None) -> T:
        """``fn(model, *args)`` at the driver's ``step`` (``RayWorkerGroup.run_on_rank0``).

        Sharded, ``model`` holds the gathered full weights: every other rank must join
        with ``gather_weights`` (or ``run``) at the same time.
        """
        with at_step(step):
            return fn(self.worker.readable_model(keep=True), *args)

    def gather_weights(self) -> None:
        """Join rank 0's gather of the full weights (sharded only; drops what it gathers)."""
        self.worker.readable_model(keep=False)

    def save_checkpoint(
        self,
        op: str,
        step: int | None,
        save: SaveCheckpoint,
        global_step: int,
        trainer_state: dict[str, Any],
    ) -> Path:
        self.fire(op, step)
        self._refuse_sharded_checkpoint()
        return save(global_step, self._write, trainer_state)

    def _write(self, directory: Path) -> None:
        self.worker.save_checkpoint(directory)
        if self.critic is not None:
            self.critic.save_checkpoint(directory)

    def load_checkpoint(self, directory: str) -> None:
        self._refuse_sharded_checkpoint()
        self.worker.load_checkpoint(Path(directory))
        if self.critic is not None:
            self.critic.load_checkpoint(Path(directory))

    def _refuse_sharded_checkpoint(self) -> None:
        if self.sharded:
            raise WorkerError(
                "policy",
                self.rank,
                None,
                "checkpoints of an FSDP2-sharded policy are not supported yet; set "
                "workers.data_parallel=replicate to save and resume (each rank then holds "
                "the whole model)",
            )

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
