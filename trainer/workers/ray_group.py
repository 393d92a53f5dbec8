"""``workers.backend=ray``: policy (and reference) workers as Ray actors, data parallel.

``RayWorkerGroup`` implements :class:`trainer.workers.group.WorkerGroup`. The policy runs
as ``num_policy_workers`` actors (ranks) in one placement group (one bundle per rank,
``PACK``: a multi-node cluster spreads them only when a node is full), joined by a
torch.distributed group (gloo for CPU tensors, NCCL for CUDA ones); the reference model, when
the KL loss is on, is one more actor; a critic (``algorithm.advantage_estimator=gae``) runs
beside the policy in each rank's actor, data parallel over the same group. Each policy actor (and the reference actor) asks Ray
for ``gpus_per_worker`` GPUs (None: 1 when the workers' device is CUDA, or ``auto`` on a
cluster with GPUs; else 0). With FSDP2 (:mod:`trainer.workers.fsdp`) every rank must run
the same passes: each rank's shard is padded to the same rows with masked copies (they add
nothing to the loss), and reading the weights on rank 0 makes every rank join the gather.
See :mod:`trainer.workers.ray_actor` for the rank's side.

Waiting: the trio thread never blocks on Ray. Every wait runs in a thread through
:func:`trainer.deadline.wait_refs` with ``timeout=remaining()``, inside
``operation(op)``, so a step deadline that expires while an actor is stuck becomes the
step's own ``StepTimeoutError`` naming stage and operation; the actor keeps running and
``shutdown`` kills it.

Errors: a remote exception of one of our classes (``trainer.*``) is re-raised as itself
with the remote traceback as a note; any other remote exception becomes
``WorkerError(worker, rank, stage, detail)`` with the remote traceback in ``detail``; an
actor that dies (``ray.kill``, OOM, a crash) becomes ``WorkerError`` naming it. Results are
awaited as they complete, so a dead rank is reported at once even while its peers block in
a collective waiting for it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import ray
import torch
import trio
from ray import ObjectRef
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import SaveCheckpoint
from trainer.errors import WorkerError
from trainer.vocabulary import (
    current_stage,
    current_step,
    get_refs_as_completed,
    operation,
    remaining,
    wait_refs,
)
from trainer.workers.batch import TrainBatch
from trainer.workers.ray_actor import PolicyActor, RefActor
from trainer.workers.ray_cluster import actor_env
from trainer.workers.ray_placement import bundles, gpus_for, padded_shard, shards
from trainer.workers.training import extreme

__all__ = ["RayWorkerGroup"]

T = TypeVar("T")

log = logging.getLogger("trainer.workers.ray")

#: How long ``shutdown`` may take (killing actors, removing the placement group).
SHUTDOWN_TIMEOUT_S = 30.0
#: Placement-group and actor start-up bound (model load included).
STARTUP_TIMEOUT_S = 300.0
#: How long past the step's deadline a rank-0 call that is never abandoned is waited for.
RANK0_GRACE_S = 30.0


def _translate(error: BaseException, worker: str, rank: int) -> BaseException:
    """Our own error class for a remote failure (see the module docstring)."""
    stage = current_stage()
    if isinstance(error, RayActorError):
        return WorkerError(worker, rank, stage, f"actor died: {error}")
    if isinstance(error, RayTaskError):
        cause = getattr(error, "cause", None)
        remote_tb = str(error)  # the remote traceback, also for the dual-class instance
        if cause is not None and type(cause).__module__.startswith("trainer."):
            cause.add_note(f"remote traceback ({worker} rank {rank}):\n{remote_tb}")
            return cause
        name = type(cause).__name__ if cause is not None else "RayTaskError"
        return WorkerError(worker, rank, stage, f"{name}: {cause}\n{remote_tb}")
    return WorkerError(worker, rank, stage, f"{type(error).__name__}: {error}")


def _summed(per_rank: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for metrics in per_rank:
        for k, v in metrics.items():
            out[k] = out.get(k, 0.0) + v
    return out


def _in_bundle(pg: PlacementGroup, index: int) -> PlacementGroupSchedulingStrategy:
    """Schedule an actor in bundle ``index`` of placement group ``pg``."""
    return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=index)


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s parameters (run on each rank by ``rank_weights``)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


async def _submit(calls: Callable[[], list[ObjectRef]]) -> list[ObjectRef]:
    """Submit actor calls in a worker thread: ``.remote`` pickles its arguments (a batch's
    tensors, megabytes) where it runs, which must not be the trio thread (DESIGN 3 rule 1).
    Not abandoned on cancel: the submission is bounded by the arguments' size, and its refs
    are what the caller waits on."""
    return await trio.to_thread.run_sync(calls)


class RayWorkerGroup:
    """Policy ranks (and a reference actor) on Ray; create with :meth:`create`."""

    def __init__(self) -> None:
        #: The policy ranks' actors in rank order (each appended as it is placed).
        self.policy: list[Any] = []
        #: The reference model's actor (None: no KL loss).
        self.ref: Any | None = None
        self._pg: PlacementGroup | None = None
        #: ``"policy:0"`` / ``"ref:0"`` -> the actor's process id (to prove they are gone)
        self.pids: dict[str, int] = {}
        self._closed = False
        #: Whether the policy is FSDP2-sharded (every rank runs every pass).
        self.sharded = False
        #: Whether each policy rank holds a critic rank.
        self.with_critic = False

    @property
    def world_size(self) -> int:
        return len(self.policy)

    @classmethod
    async def create(
        cls,
        model_dir: Path,
        *,
        policy_kwargs: dict[str, object],
        with_ref: bool,
        num_workers: int,
        collective_timeout_s: float = 1800.0,
        sharded: bool = False,
        gpus_per_worker: float | None = None,
        critic_kwargs: dict[str, object] | None = None,
    ) -> RayWorkerGroup:
        """Place and start the actors, then form the data-parallel group (bounded). With
        ``critic_kwargs`` every policy rank holds a critic rank too.

        ``policy_kwargs["device"]`` (default ``auto``) decides, with ``gpus_per_worker``,
        the GPUs each actor asks for (:func:`gpus_for`). ``sharded``: the ranks shard the
        policy with FSDP2 (the run plan's decision, ``workers.data_parallel``); never at one
        rank.
        """
        group = cls()
        group.with_critic = critic_kwargs is not None
        wanted: list[dict[str, float]] = []  # the bundles asked for, named if never placed
        place = functools.partial(
            group._place_actors,
            model_dir,
            wanted,
            actor_env(),
            policy_kwargs=policy_kwargs,
            with_ref=with_ref,
            num_workers=num_workers,
            sharded=sharded,
            gpus_per_worker=gpus_per_worker,
            critic_kwargs=critic_kwargs,
        )
        try:
            with trio.fail_after(STARTUP_TIMEOUT_S):
                await trio.to_thread.run_sync(place, abandon_on_cancel=True)
                await group._form_group(collective_timeout_s)
        except (trio.TooSlowError, GetTimeoutError):
            with trio.CancelScope(shield=True):
                await group.shutdown()
            raise WorkerError(
                "policy",
                0,
                current_stage(),
                f"not placed and started within {STARTUP_TIMEOUT_S:g}s: the run needs the "
                f"bundles {wanted} in one placement group (`ray status` shows what is free; "
                "engines placed by Ray take engine.ray_num_cpus each)",
            ) from None
        except BaseException:
            with trio.CancelScope(shield=True):
                await group.shutdown()
            raise
        log.info("ray workers up: %s", group.pids)
        return group

    def _place_actors(
        self,
        model_dir: Path,
        wanted: list[dict[str, float]],
        env: dict[str, str],
        *,
        policy_kwargs: dict[str, object],
        with_ref: bool,
        num_workers: int,
        sharded: bool,
        gpus_per_worker: float | None,
        critic_kwargs: dict[str, object] | None,
    ) -> None:
        """The placement group (its bundles written into ``wanted`` first) and the actors in
        it: the policy ranks, then the reference actor. Blocking (GCS round-trips): run it in
        a thread."""
        device = str(policy_kwargs.get("device", "auto"))
        gpus = gpus_for(gpus_per_worker, device)
        wanted[:] = bundles(num_workers, gpus, with_ref)
        self._pg = pg = placement_group(wanted, strategy="PACK")
        ray.get(pg.ready(), timeout=STARTUP_TIMEOUT_S)
        for rank in range(num_workers):
            self.policy.append(
                ray.remote(PolicyActor)
                .options(
                    num_cpus=1,
                    num_gpus=gpus,
                    scheduling_strategy=_in_bundle(pg, rank),
                    runtime_env={"env_vars": env},
                )
                .remote(str(model_dir), rank, num_workers, policy_kwargs, sharded, critic_kwargs)
            )
        if with_ref:
            # on GPUs, in its own bundle of the group; on the CPU, beside the policy
            placed = {"scheduling_strategy": _in_bundle(pg, num_workers)} if gpus else {}
            self.ref = (
                ray.remote(RefActor)
                .options(num_cpus=0, num_gpus=gpus, runtime_env={"env_vars": env}, **placed)
                .remote(
                    str(model_dir),
                    policy_kwargs.get("temperature", 1.0),
                    policy_kwargs.get("micro_batch_size"),
                    device,
                    str(policy_kwargs.get("dtype", "auto")),
                    policy_kwargs.get("micro_batch_max_tokens"),
                )
            )

    async def _form_group(self, collective_timeout_s: float) -> None:
        """Wait for the placed actors (their process ids), then join the policy ranks in one
        torch.distributed group; ``sharded`` says whether they shard the policy."""
        pids = await self._wait([a.pid.remote() for a in self._actors()], self._names())
        self.pids = {f"{w}:{r}": pid for (w, r), pid in zip(self._names(), pids)}
        host, port = (await self._wait([self.policy[0].master_address.remote()]))[0]
        with operation("init_process_group"):
            sharded = await self._wait(
                [a.init_group.remote(host, port, collective_timeout_s) for a in self.policy]
            )
        self.sharded = any(sharded)

    def _actors(self) -> list[Any]:
        return [*self.policy, *([self.ref] if self.ref is not None else [])]

    def _names(self) -> list[tuple[str, int]]:
        names = [("policy", r) for r in range(len(self.policy))]
        return names + ([("ref", 0)] if self.ref is not None else [])

    async def _wait(
        self,
        refs: Sequence[ObjectRef],
        who: list[tuple[str, int]] | None = None,
    ) -> list[Any]:
        """Await ``refs`` off the trio thread under the step's deadline; translate failures."""
        names = who or [("policy", r) for r in range(len(refs))]
        return await wait_refs(refs, lambda i, error: _translate(error, *names[i]))

    async def _call_policy(
        self, op: str, method: str, make_args: Callable[[int], tuple[object, ...]] | None = None
    ) -> list[Any]:
        step = current_step()
        with operation(op):
            refs = await _submit(
                lambda: [
                    getattr(actor, method).remote(op, step, *(make_args(r) if make_args else ()))
                    for r, actor in enumerate(self.policy)
                ]
            )
            return await self._wait(refs)

    def _rank_batches(self, batch: TrainBatch) -> list[TrainBatch | None]:
        """Each rank's rows (None: none); sharded, every rank gets the same number."""
        parts = shards(len(batch), self.world_size)
        if self.sharded:
            size = max(s.stop - s.start for s in parts)
            return [padded_shard(batch, s, size) for s in parts]
        return [batch.select(s) if s.stop > s.start else None for s in parts]

    async def _forward(self, op: str, method: str, batch: TrainBatch) -> torch.Tensor:
        """Each rank computes its shard by ``method``; the rows come back in order (padding
        dropped)."""
        parts = shards(len(batch), self.world_size)
        step = current_step()
        with operation(op):
            refs = await _submit(
                lambda: [
                    getattr(self.policy[r], method).remote(op, step, b)
                    for r, b in enumerate(self._rank_batches(batch))
                    if b is not None
                ]
            )
            out = await self._wait(refs)
        return await trio.to_thread.run_sync(
            lambda: torch.cat([o[: s.stop - s.start] for o, s in zip(out, parts)], dim=0)
        )

    async def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return await self._forward("forward", "compute_logprobs", batch)

    async def compute_values(self, batch: TrainBatch) -> torch.Tensor | None:
        if not self.with_critic:
            return None
        return await self._forward("critic_forward", "compute_values", batch)

    async def compute_ref_logprobs(self, batch: TrainBatch) -> torch.Tensor | None:
        if self.ref is None:
            return None
        ref_actor, step = self.ref, current_step()
        with operation("forward"):
            refs = await _submit(
                lambda: [ref_actor.compute_logprobs.remote("forward", step, batch)]
            )
            return (await self._wait(refs, [("ref", 0)]))[0]

    async def _accumulate(
        self, op: str, batch: TrainBatch, counts: BatchCounts
    ) -> dict[str, float]:
        """Each rank accumulates its shard's share of the mini-batch's loss by ``op`` (the
        actor method of that name), normalized by the whole mini-batch's ``counts``; metrics
        merged: max of maxima, min of minima, others summed (sums and global-token-weighted
        means add up across ranks)."""
        parts = await trio.to_thread.run_sync(self._rank_batches, batch)

        def args(rank: int) -> tuple[object, ...]:
            return (parts[rank], counts)

        merged: dict[str, float] = {}
        for metrics in await self._call_policy(op, op, args):
            for k, v in metrics.items():
                if fold := extreme(k):
                    merged[k] = fold((merged[k], v)) if k in merged else v
                else:
                    merged[k] = merged.get(k, 0.0) + v
        return merged

    async def forward_backward(self, batch: TrainBatch, counts: BatchCounts) -> dict[str, float]:
        return await self._accumulate("forward_backward", batch, counts)

    async def optim_step(self) -> dict[str, float]:
        """All ranks step the same all-reduced gradient; rank 0's metrics."""
        return (await self._call_policy("optim_step", "optim_step"))[0]

    async def critic_forward_backward(
        self, batch: TrainBatch, counts: BatchCounts
    ) -> dict[str, float]:
        return await self._accumulate("critic_forward_backward", batch, counts)

    async def critic_optim_step(self) -> dict[str, float]:
        return (await self._call_policy("critic_optim_step", "critic_optim_step"))[0]

    async def offload_to_cpu(self) -> dict[str, float]:
        """Every rank offloads; the bytes are summed over the ranks."""
        return _summed(await self._call_policy("offload_to_cpu", "offload_to_cpu"))

    async def backload_to_gpu(self) -> dict[str, float]:
        return _summed(await self._call_policy("backload_to_gpu", "backload_to_gpu"))

    async def rank_weights(self) -> list[dict[str, torch.Tensor]]:
        """Every rank's weights (for checks that the ranks agree; sharded: each gathers)."""
        return await self._wait([a.run.remote(parameters_of, (), None) for a in self.policy])

    async def run_on_rank0(
        self, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False
    ) -> T:
        """``fn(policy.model, *args)`` in rank 0's actor (see ``WorkerGroup``).

        Abandoned: the wait is :func:`wait_refs` (bounded by the step's remaining budget).
        Not abandoned: a cancellation waits for the actor, bounded by the remaining budget
        plus :data:`RANK0_GRACE_S` (the actor's own collectives are bounded by the budget),
        then ``WorkerError``; without a deadline, until the actor answers.
        """
        ref = self.policy[0].run.remote(fn, args, current_step())
        # sharded, the other ranks join the gather of the full weights
        refs = [ref, *(a.gather_weights.remote() for a in self.policy[1:] if self.sharded)]
        if abandon_on_cancel:
            return (await self._wait(refs))[0]
        left = remaining()
        bound = None if left is None else left + RANK0_GRACE_S

        def failed(rank: int, error: BaseException) -> BaseException:  # refs are in rank order
            return _translate(error, "policy", rank)

        try:
            return (await trio.to_thread.run_sync(get_refs_as_completed, refs, bound, failed))[0]
        except GetTimeoutError:
            raise WorkerError(
                "policy",
                0,
                current_stage(),
                f"{getattr(fn, '__name__', fn)} on rank 0 not done within {bound:g}s",
            ) from None

    async def save_checkpoint(
        self, save: SaveCheckpoint, step: int, trainer_state: dict[str, object]
    ) -> Path:
        """Rank 0 writes the checkpoint (the ranks' states are identical); ``save`` travels
        to its actor (a bound ``CheckpointManager.save`` pickles with its manager)."""
        with operation("save_checkpoint"):
            ref = self.policy[0].save_checkpoint.remote(
                "save_checkpoint", current_step(), save, step, trainer_state
            )
            return (await self._wait([ref]))[0]

    async def load_checkpoint(self, directory: Path) -> None:
        await self._wait([a.load_checkpoint.remote(str(directory)) for a in self.policy])

    async def shutdown(self) -> None:
        """Kill every actor and remove the placement group; bounded, idempotent.

        Killing (not a graceful call) because a rank may be stuck in a method or a
        collective; ``ray.kill`` ends its process. Safe to call after a hang or a death.
        """
        if self._closed:
            return
        self._closed = True
        actors, pg = self._actors(), self._pg

        def kill_all() -> None:
            for actor in actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception as exc:  # already dead or never created
                    log.debug("ray.kill: %r", exc)
            try:
                if pg is not None:
                    remove_placement_group(pg)
            except Exception as exc:
                log.debug("remove_placement_group: %r", exc)

        with trio.move_on_after(SHUTDOWN_TIMEOUT_S) as scope:
            await trio.to_thread.run_sync(kill_all, abandon_on_cancel=True)
        if scope.cancelled_caught:
            log.warning("ray worker shutdown did not finish in %.0fs", SHUTDOWN_TIMEOUT_S)
