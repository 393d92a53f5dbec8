"""``workers.backend=local``: policy, reference and critic workers in this process, run in
threads.

Each call runs the worker's method through ``trio.to_thread.run_sync`` so the event loop
keeps serving generation while the model computes; a per-worker ``CapacityLimiter(1)``
serialises calls into one worker. The thread is abandoned when the driver's wait is
cancelled (a step deadline, or a failed rollout under fully-async): a hung method keeps its
thread, which holds the limiter until it returns, so no second call can run concurrently
with it. :meth:`LocalWorkerGroup.shutdown` waits, bounded, for an abandoned call that is
still computing (a training call: forward, backward, optimizer step): a process that exits
while a thread is inside a torch kernel can abort (SIGABRT, "terminate called without an
active exception"). A thread held by a ``hang`` fault, or a rank-0 call of a weight
transport left waiting in a rendezvous or collective (bounded by its own timeout), is only
waiting, and is left to die with the process (worker threads are daemons).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import torch
import trio

from engines.cpu_share import CpuShare, own_thread_id, thread_times
from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import SaveCheckpoint
from trainer.vocabulary import fire_fault_sync, operation
from trainer.workers.batch import TrainBatch
from trainer.workers.critic import CriticWorker
from trainer.workers.policy import PolicyWorker, RefWorker

__all__ = ["SHUTDOWN_WAIT_S", "LocalWorkerGroup"]

log = logging.getLogger("trainer.workers")

T = TypeVar("T")


def _on_readable_model(policy: PolicyWorker, fn: Callable[..., T], *args: object) -> T:
    """``fn`` on the policy's full weights (a LoRA policy's merged ones), in the calling thread."""
    return fn(policy.readable_model(), *args)


#: How long shutdown waits for a worker call still computing after its wait was cancelled.
SHUTDOWN_WAIT_S = 30.0


class LocalWorkerGroup:
    """Implements :class:`trainer.workers.group.WorkerGroup` with in-process workers."""

    def __init__(
        self,
        policy: PolicyWorker,
        ref: RefWorker | None,
        critic: CriticWorker | None = None,
        *,
        threads: int | None = None,
    ) -> None:
        #: ``threads``: the most torch threads a call uses, fewer while the machine's other
        #: processes hold cores (:class:`engines.cpu_share.CpuShare`); None: torch's own. The
        #: thread that builds the group (the trio thread, which runs the generators' HTTP
        #: streams while the engines sample) is not counted.
        read = functools.partial(thread_times, exclude=(own_thread_id(),))
        self.cpu = CpuShare(threads, read=read) if threads else None
        self.policy = policy
        self.ref = ref
        self.critic = critic
        self._policy_limiter = trio.CapacityLimiter(1)
        self._ref_limiter = trio.CapacityLimiter(1)
        self._critic_limiter = trio.CapacityLimiter(1)
        #: Worker threads inside a fault right now (a ``hang`` there is a wait, not a kernel).
        self._in_fault = 0
        #: Training calls computing right now (what shutdown waits for); under ``_count_lock``.
        self._computing = 0
        self._count_lock = threading.Lock()

    def _fire_then(self, op: str, fn: Callable[..., T], *args: object) -> T:
        with self._count_lock:
            self._in_fault += 1
        try:
            fire_fault_sync(op)  # where the operation really runs: this worker thread
        except BaseException:
            with self._count_lock:  # an ``error`` fault: the call ends here, computing nothing
                self._in_fault -= 1
            raise
        with self._count_lock:
            self._in_fault -= 1
            self._computing += 1
        try:
            if self.cpu is not None:  # torch's thread count is this thread's
                torch.set_num_threads(self.cpu.threads())
            return fn(*args)
        finally:
            with self._count_lock:
                self._computing -= 1

    @classmethod
    async def create(
        cls,
        model_dir: Path,
        *,
        policy_kwargs: dict[str, Any],
        with_ref: bool,
        critic_kwargs: dict[str, Any] | None = None,
        threads: int | None = None,
    ) -> LocalWorkerGroup:
        """The workers, each built in a thread: the policy from ``model_dir``, the reference
        when ``with_ref``, a critic when ``critic_kwargs`` (its ``model_dir`` among them).
        ``threads``: the most torch threads a call uses (see ``__init__``)."""
        policy = await trio.to_thread.run_sync(
            functools.partial(PolicyWorker, model_dir, **policy_kwargs)
        )
        ref = None
        if with_ref:
            ref = await trio.to_thread.run_sync(
                functools.partial(
                    RefWorker,
                    model_dir,
                    temperature=policy_kwargs.get("temperature", 1.0),
                    micro_batch_size=policy_kwargs.get("micro_batch_size"),
                    micro_batch_max_tokens=policy_kwargs.get("micro_batch_max_tokens"),
                    device=policy_kwargs.get("device", "auto"),
                    dtype=policy_kwargs.get("dtype", "auto"),
                )
            )
        critic = None
        if critic_kwargs is not None:
            critic = await trio.to_thread.run_sync(functools.partial(CriticWorker, **critic_kwargs))
        return cls(policy, ref, critic, threads=threads)

    async def _call(
        self, op: str, limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: object
    ) -> T:
        with operation(op):
            return await trio.to_thread.run_sync(
                self._fire_then,
                op,
                fn,
                *args,
                abandon_on_cancel=True,
                limiter=limiter,
                thread_name=f"worker:{op}",
            )

    async def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return await self._call(
            "forward", self._policy_limiter, self.policy.compute_logprobs, batch
        )

    async def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref is None:
            return None
        return await self._call("forward", self._ref_limiter, self.ref.compute_logprobs, batch)

    async def forward_backward(self, batch: TrainBatch, counts: BatchCounts) -> dict[str, float]:
        return await self._call(
            "forward_backward",
            self._policy_limiter,
            self.policy.forward_backward,
            batch,
            counts,
        )

    async def optim_step(self) -> dict[str, float]:
        return await self._call("optim_step", self._policy_limiter, self.policy.optim_step)

    async def compute_values(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.critic is None:
            return None
        return await self._call(
            "critic_forward", self._critic_limiter, self.critic.compute_values, batch
        )

    async def critic_forward_backward(
        self, batch: TrainBatch, counts: BatchCounts
    ) -> dict[str, float]:
        assert self.critic is not None, "this group has no critic"
        return await self._call(
            "critic_forward_backward",
            self._critic_limiter,
            self.critic.forward_backward,
            batch,
            counts,
        )

    async def critic_optim_step(self) -> dict[str, float]:
        assert self.critic is not None, "this group has no critic"
        return await self._call("critic_optim_step", self._critic_limiter, self.critic.optim_step)

    async def offload_to_cpu(self) -> dict[str, float]:
        return await self._call("offload_to_cpu", self._policy_limiter, self.policy.offload_to_cpu)

    async def backload_to_gpu(self) -> dict[str, float]:
        return await self._call(
            "backload_to_gpu", self._policy_limiter, self.policy.backload_to_gpu
        )

    async def run_on_rank0(
        self, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False
    ) -> T:
        """``fn(policy's readable model, *args)`` in the policy's thread (see ``WorkerGroup``).

        It holds the policy's limiter, so it never runs beside a training call.
        """
        return await trio.to_thread.run_sync(
            functools.partial(_on_readable_model, self.policy, fn, *args),
            abandon_on_cancel=abandon_on_cancel,
            limiter=self._policy_limiter,
            thread_name=f"worker:rank0:{getattr(fn, '__name__', 'fn')}",
        )

    async def save_checkpoint(
        self, save: SaveCheckpoint, step: int, trainer_state: dict[str, Any]
    ) -> Path:
        """Write ``global_step_N`` through ``save`` (operation ``save_checkpoint``): the
        policy's files and the critic's (holding both workers' limiters)."""
        async with self._critic_limiter:
            return await self._call(
                "save_checkpoint", self._policy_limiter, save, step, self._write, trainer_state
            )

    def _write(self, directory: Path) -> None:
        self.policy.save_checkpoint(directory)
        if self.critic is not None:
            self.critic.save_checkpoint(directory)

    def _read(self, directory: Path) -> None:
        self.policy.load_checkpoint(directory)
        if self.critic is not None:
            self.critic.load_checkpoint(directory)

    async def load_checkpoint(self, directory: Path) -> None:
        async with self._critic_limiter:
            await trio.to_thread.run_sync(
                self._read, directory, abandon_on_cancel=True, limiter=self._policy_limiter
            )

    async def shutdown(self) -> None:
        """Wait up to ``SHUTDOWN_WAIT_S`` for training calls still computing (see the module
        docstring); a call held by a fault, a rank-0 call left waiting, or one past the bound
        is left behind."""
        with trio.move_on_after(SHUTDOWN_WAIT_S) as waited:
            # polled: the count drops in abandoned threads, which have no trio token to signal
            while self._computing:  # noqa: ASYNC110
                await trio.sleep(0.05)
        if waited.cancelled_caught:
            log.warning(
                "a worker call was still computing %.0fs after its run ended; exiting anyway",
                SHUTDOWN_WAIT_S,
            )
