"""``RunContext``: what the loop's stages need of a run, built by ``trainer.run._train``; the
``Strategy`` protocol it holds."""

from __future__ import annotations

import logging
import resource
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar, Protocol

import attrs
import trio

from engines.types import EngineClient, PromptLogprob
from sync.transports import WeightTransport
from trainer.algorithms import KlController
from trainer.checkpoint import CheckpointManager
from trainer.config import Config
from trainer.data import Example, PromptLoader
from trainer.debug import StallInstrument, Watchdog
from trainer.generators import Generator
from trainer.loop._engine_recovery import EngineRecovery
from trainer.loop._prompt_stream import PromptStream
from trainer.loop._versions import WeightVersions
from trainer.metrics import MetricsLogger, StepProgress, TrackerSink, end_step
from trainer.workers.group import WorkerGroup

__all__ = ["SLOW_STALL_MS", "RunContext", "StepFn", "Strategy", "Teacher"]

log = logging.getLogger("trainer.run")
#: A step whose longest event-loop stall exceeds this logs the task that caused it.
SLOW_STALL_MS = 100.0


#: One step: its number in, its metrics out.
StepFn = Callable[[int], Awaitable[dict[str, Any]]]


class Strategy(Protocol):
    """What the loop needs of ``trainer.strategy`` (``trainer.loop._strategy`` builds one)."""

    #: Whether rollouts go on while the policy trains and syncs (the sync's bracket differs).
    rollouts_continue: ClassVar[bool]
    loader: PromptLoader
    versions: WeightVersions

    @property
    def order(self) -> PromptLoader | PromptStream:
        """What holds the data position: saved in a checkpoint, loaded on resume."""
        ...

    def rollout_engine(self, engine: EngineClient, cfg: Config) -> EngineClient:
        """The engine the training generator sees."""
        ...

    def steps(self, ctx: RunContext) -> AbstractAsyncContextManager[StepFn]:
        """``async with strategy.steps(ctx) as step:`` what runs around the steps, and one step."""
        ...

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        """The strategy's own metrics of a finished step."""
        ...


class Teacher(Protocol):
    """The engine serving ``algorithm.distillation``'s teacher (``engines.client.InferenceClient``)."""

    async def prompt_logprobs(
        self, token_ids: list[int], k: int = 0, *, trajectory_id: str | None = None
    ) -> list[PromptLogprob | None]:
        """Per token of ``token_ids``, None for the first, then its logprob given those before."""
        ...


@attrs.define(eq=False)
class RunContext:
    """Config, data, generators, engine, transport, workers, checkpoints and loggers of a run."""

    cfg: Config
    run_dir: Path
    tokenizer: Any
    #: ``trainer.strategy``: the data source, the served weight versions, how a step runs.
    strategy: Strategy
    generator: Generator
    #: Greedy rollouts for eval (``None`` when ``trainer.eval_interval`` is 0).
    eval_generator: Generator | None
    eval_examples: list[Example]
    #: The inference client (``engines.client.InferenceClient`` or an in-process engine).
    engine: EngineClient
    transport: WeightTransport
    workers: WorkerGroup
    ckpt: CheckpointManager
    metrics: MetricsLogger
    progress: StepProgress
    #: The first step to run (1, or the step after a resumed checkpoint) and the last one.
    first_step: int
    last_step: int
    stalls: StallInstrument = attrs.field(factory=StallInstrument)
    #: Times each step and dumps the run when one runs long (None: no watchdog).
    watchdog: Watchdog | None = None
    #: The trackers of ``trainer.loggers`` besides ``metrics.jsonl`` (none by default).
    trackers: TrackerSink = attrs.field(factory=TrackerSink)
    #: Sampled eval rollouts on the engines directly (``trainer.eval_n_samples_per_prompt``).
    eval_sampled_generator: Generator | None = None
    #: Restarts failed engines (``engine.max_restarts``); None where recovery does not apply.
    recovery: EngineRecovery | None = None
    #: ``algorithm.distillation``'s teacher; None when the run distills nothing.
    teacher: Teacher | None = None
    #: The KL in the reward's coefficient (``algorithm.use_kl_in_reward``; None: off): the
    #: run's state, kept by its checkpoints.
    kl_ctrl: KlController | None = None
    #: Held while the policy trains and syncs: a restarted engine's sync waits for it (and
    #: so never reads a policy mid-update); the recovery's own lock when there is one.
    weights_lock: trio.Lock = attrs.field(
        default=attrs.Factory(
            lambda self: self.recovery.weights_lock if self.recovery else trio.Lock(),
            takes_self=True,
        )
    )

    @property
    def versions(self) -> WeightVersions:
        """The weight version the engines serve (``sync/weight_version``), counted once."""
        return self.strategy.versions

    def data_state(self) -> dict[str, Any]:
        """Where the data is, for a checkpoint (the strategy's loader, or its stream)."""
        return self.strategy.order.state_dict()

    @contextmanager
    def watching(self, step: int) -> Iterator[None]:
        """Step ``step`` runs inside, timed by the watchdog (see ``Watchdog.watching``)."""
        with self.watchdog.watching(step) if self.watchdog else nullcontext():
            yield

    def checkpoint_due(self, step: int) -> bool:
        """Every ``trainer.ckpt_interval`` steps, and the last step (when checkpointing at all)."""
        interval = self.cfg.trainer.ckpt_interval
        return interval > 0 and (step % interval == 0 or step == self.last_step)

    def eval_due(self, step: int) -> bool:
        """After ``step`` (0: before the first step, ``trainer.eval_before_train``)."""
        t = self.cfg.trainer
        if self.eval_generator is None or t.eval_interval == 0:
            return False
        if step == self.first_step - 1:
            return t.eval_before_train and step == 0
        return step % t.eval_interval == 0

    def loop_metrics(self) -> dict[str, float]:
        """Event-loop health over the step: the longest time the trio thread did not yield."""
        culprit = self.stalls.worst_task
        stall_ms = self.stalls.take_max_ms()
        if stall_ms > SLOW_STALL_MS:
            log.info("event loop stalled %.0f ms in task %s", stall_ms, culprit)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        metrics = {"loop/max_stall_ms": stall_ms, "memory/peak_rss_gb": peak_kib / 2**20}
        if self.recovery is not None:
            metrics["engine/restarts"] = float(self.recovery.total_restarts)
        return metrics

    def record_step(self, metrics: dict[str, Any]) -> None:
        self.metrics.log(metrics)
        self.trackers.log(metrics)
        self.progress.update(metrics["step"], metrics)
        log.info(
            "step %d reward %.3f step_s %.2f",
            metrics["step"],
            metrics["reward/mean"],
            metrics["timing/step"],
        )
        end_step(metrics["step"])  # the step's repeated warnings: one line each, counted

    def record_eval(self, step: int, metrics: dict[str, float]) -> None:
        self.metrics.log({"step": step, **metrics})
        self.trackers.log({"step": step, **metrics})
        log.info("eval at step %d: %s", step, metrics)
