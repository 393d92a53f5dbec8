"""``trainer.strategy=fully_async``: rollouts keep running while the policy trains.

The run's nursery owns ``generator.num_parallel_workers`` rollout tasks. Each admits a
group (:mod:`trainer.loop._staleness`), takes a prompt (:mod:`trainer.loop._prompt_stream`), rolls out
its ``n_samples_per_prompt`` trajectories with the run's generator (one ``generate`` call:
the generator API of the synchronous loop) and puts the finished group in a bounded memory
channel. Each step takes ``train_batch_size`` groups from it (stage
``wait_for_generation_buffer``, operation ``wait_for_batch``, under the step's deadline),
trains on them with the synchronous loop's stages, and syncs weights every
``trainer.fully_async.sync_interval`` steps while the rollouts go on (``engine.pause_mode``
says what happens to requests in flight; see :mod:`trainer.loop._rollout_versions`).

How it ends (DESIGN 3): a rollout task's error cancels the steps and the other rollouts and
is the run's error, raised as itself; a wait past the step's deadline is the step's
``StepTimeoutError`` and cancels the rollouts; after the last step the rollouts are
cancelled and the run returns with nothing left running. Groups in flight are not lost: a
checkpoint names them and a resume rolls them out again.

A rollout that runs past its own bound (``generator.rollout_timeout_s``, by default
``trainer.step_timeout_s``) is given up, not failed: it is cancelled, logged, counted in
``async/rollouts_timed_out``, its prompt re-queued and its admission given back, so later
groups no longer overtake a hung one for the rest of the run. The same prompt cut off
:data:`ROLLOUT_ATTEMPTS` times in a row ends the run with ``RolloutTimeoutError``: when every
rollout hangs, retrying would otherwise go on forever.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from trainer.data import Example
from trainer.errors import RolloutTimeoutError
from trainer.generators import GeneratorInput, GeneratorOutput
from trainer.loop import _stages as stages
from trainer.loop._context import RunContext, StepFn
from trainer.loop._dynamic_sampling import FilterCount, is_informative
from trainer.loop._prompt_stream import PromptKey, PromptStream
from trainer.loop._staleness import Admission, staleness
from trainer.loop._steps import sync_weights, train_on
from trainer.loop._versions import WeightVersions
from trainer.vocabulary import (
    Bound,
    Timer,
    at_step,
    bounded,
    fire_fault,
    open_owner_nursery,
    operation,
    stage,
)

__all__ = ["ROLLOUT_ATTEMPTS", "RolloutFeed", "rolling_out"]

log = logging.getLogger("trainer.fully_async")

#: A prompt whose rollout runs past ``generator.rollout_timeout_s`` this many times in a row
#: ends the run (``RolloutTimeoutError``); fewer are retried.
ROLLOUT_ATTEMPTS = 3


@asynccontextmanager
async def rolling_out(ctx: RunContext, prompts: PromptStream) -> AsyncIterator[StepFn]:
    """The rollout tasks run inside (in an owner nursery); yields one step of this strategy.

    Entered after the first weight sync and its eval, so the rollouts start on the synced
    policy. Once the steps are done the rollouts are stopped (a resume rolls their prompts
    out again); an error of one cancels the steps and is the run's.
    """
    feed = RolloutFeed(ctx, prompts)
    async with open_owner_nursery() as nursery:
        for _ in range(ctx.cfg.generator.num_parallel_workers):
            nursery.start_soon(feed.roll_out_groups)

        async def step(n: int) -> dict[str, object]:
            return await run_async_step(ctx, feed, n)

        yield step
        # the last step is done: stop the rollouts (a resume would roll their prompts out again)
        log.info(
            "stopping the rollouts: %d groups in flight%s",
            len(feed.prompts.in_flight),
            feed.longest_running(),
        )
        nursery.cancel_scope.cancel()


async def run_async_step(ctx: RunContext, feed: RolloutFeed, step: int) -> dict[str, object]:
    """One step: wait for a batch of groups, score, compute advantages, train, maybe
    checkpoint, maybe sync weights (rollouts continue throughout)."""
    timings: dict[str, float] = {}
    if ctx.recovery is not None:
        ctx.recovery.step = step
    with Timer("wait_for_generation_buffer", timings):
        groups, metrics = await feed.take_batch(step)
    prompts = [g.example for g in groups]
    # a restarted engine's sync waits until the policy is synced (or between two steps)
    async with ctx.weights_lock:
        metrics |= await train_on(ctx, step, prompts, merge_groups(groups), timings)
        if step % ctx.cfg.trainer.fully_async.sync_interval == 0 or step == ctx.last_step:
            with Timer("sync_weights", timings):
                metrics |= await sync_weights(ctx, step)  # admission counts from the new step
        else:
            metrics["sync/weight_version"] = ctx.versions.current
    return metrics | {f"timing/{k}": v for k, v in timings.items()}


@attrs.frozen
class Group:
    """One prompt's rolled-out trajectories, waiting to be trained on."""

    key: PromptKey
    example: Example
    output: GeneratorOutput
    #: The trained step whose weights the engines served when the group started.
    policy_step: int


def merge_groups(groups: list[Group]) -> GeneratorOutput:
    """One step's rollouts: group ``g``'s trajectories get ``group_id = g``; metrics averaged."""
    trajectories = []
    for g, group in enumerate(groups):
        for t in group.output.trajectories:
            t.group_id = g
            trajectories.append(t)
    keys = {k for group in groups for k in group.output.metrics}
    metrics = {
        k: statistics.fmean(g.output.metrics[k] for g in groups if k in g.output.metrics)
        for k in sorted(keys)
    }
    return GeneratorOutput(trajectories, metrics)


class RolloutFeed:
    """The rollout tasks' side: admission, prompts, the buffer, and the step's async metrics."""

    def __init__(self, ctx: RunContext, prompts: PromptStream) -> None:
        self.ctx = ctx
        self.prompts = prompts
        self.versions: WeightVersions = ctx.versions
        fa = ctx.cfg.trainer.fully_async
        self.batch_size = ctx.cfg.trainer.train_batch_size
        self.max_staleness = fa.max_staleness_steps
        # after the first sync: the engines serve the resumed step's policy (0 when fresh)
        self.admission = Admission.resumed(self.batch_size, self.max_staleness, self.versions)
        # admission bounds what is buffered by (max_staleness + 1) batches: a send never waits
        self._send, self._receive = trio.open_memory_channel[Group](
            (self.max_staleness + 1) * self.batch_size
        )
        g, t = ctx.cfg.generator, ctx.cfg.trainer
        #: Each rollout's bound in seconds (None: unbounded): generator.rollout_timeout_s,
        #: else the step's budget, which a rollout that a step waits for cannot outlive anyway.
        self.rollout_timeout_s = (
            g.rollout_timeout_s if g.rollout_timeout_s is not None else t.step_timeout_s
        )
        # per prompt, how many of its rollouts in a row were cut off at the bound
        self._cut_off: dict[PromptKey, int] = {}
        # rollouts cut off since the last step took its batch (async/rollouts_timed_out)
        self._timed_out = 0
        # when each running rollout started (trio clock), for the log at the end
        self._running: dict[PromptKey, float] = {}
        # the integral of the number of rollout tasks waiting (for admission or a prompt)
        self._waiting = 0
        self._idle_s = 0.0
        self._last_change = self._mark = trio.current_time()

    def _count_waiting(self, change: int) -> None:
        now = trio.current_time()
        self._idle_s += self._waiting * (now - self._last_change)
        self._waiting += change
        self._last_change = now

    async def roll_out_groups(self) -> None:
        """One rollout task: admit a group, roll it out, buffer it; again until cancelled.

        A rollout past :attr:`rollout_timeout_s` is cancelled and handed out again
        (:meth:`_cut_off_rollout`); ``RolloutTimeoutError`` when that was the prompt's
        :data:`ROLLOUT_ATTEMPTS`-th time in a row.
        """
        while True:
            self._count_waiting(+1)
            try:
                policy_step = await self.admission.admit()
                key, example = await self.prompts.take()
            finally:
                self._count_waiting(-1)
            version = self.versions.current
            # its step (in errors, dumps and fault specs) is the first that may train on it
            step = policy_step + 1
            self._running[key] = trio.current_time()
            try:
                with bounded(self.rollout_timeout_s) as bound:
                    with at_step(step), stage("generate"):
                        out = await self.ctx.generator.generate(
                            self.group_input(key, example, version, step)
                        )
            finally:
                del self._running[key]
            if bound.expired:
                self._cut_off_rollout(key, step, bound)
                continue
            self._cut_off.pop(key, None)
            for t in out.trajectories:
                if not t.weight_versions:  # a generator that does not pass them on
                    t.weight_versions = [version if m else -1 for m in t.loss_mask]
            await self._send.send(Group(key, example, out, policy_step))

    def _cut_off_rollout(self, key: PromptKey, step: int, bound: Bound) -> None:
        """A rollout ran past its bound: hand its prompt out again, or end the run."""
        stage_name, op = bound.hit_at or ("generate", "await")
        attempts = self._cut_off.get(key, 0) + 1
        assert self.rollout_timeout_s is not None
        if attempts >= ROLLOUT_ATTEMPTS:
            raise RolloutTimeoutError(step, key, attempts, self.rollout_timeout_s, stage_name, op)
        self._cut_off[key] = attempts
        self._timed_out += 1
        log.warning(
            "the rollout of prompt (epoch %d, position %d) for step %d ran past its %gs bound "
            "(generator.rollout_timeout_s) in stage=%r operation=%r: cancelled, its prompt "
            "handed out again (attempt %d of %d)",
            *key,
            step,
            self.rollout_timeout_s,
            stage_name,
            op,
            attempts,
            ROLLOUT_ATTEMPTS,
        )
        self.prompts.requeue(key)
        self.admission.release()

    def longest_running(self) -> str:
        """``"; the longest running for 12.3s"`` (for the log), or ``""`` when none runs."""
        if not self._running:
            return ""
        return f"; the longest running for {trio.current_time() - min(self._running.values()):.1f}s"

    def group_input(
        self, key: PromptKey, example: Example, version: int, step: int
    ) -> GeneratorInput:
        """One prompt's ``n_samples_per_prompt`` trajectories (:func:`stages.group_inputs`),
        their seeds and ids fixed by the prompt's key, not by when it happens to start."""
        epoch, position = key
        first_seed = self.ctx.cfg.trainer.seed * 1_000_003 + epoch * 7_919_993 + position * 10_007
        items = stages.group_inputs(
            self.ctx,
            example,
            0,
            self.ctx.cfg.generator.n_samples_per_prompt,
            ids=f"e{epoch}p{position}",
            first_seed=first_seed,
        )
        return GeneratorInput(tuple(items), global_step=step, weight_version=version)

    async def take_batch(self, step: int) -> tuple[list[Group], dict[str, float]]:
        """``train_batch_size`` groups within the staleness bound, and the step's async metrics.

        A group older than the bound is dropped (its prompt re-queued, its place in the
        admission given back) and counted in ``async/dropped_stale``; rollouts cut off since
        the previous batch are counted in ``async/rollouts_timed_out``.
        """
        groups: list[Group] = []
        dropped = 0
        sampling = self.ctx.cfg.algorithm.dynamic_sampling
        count = FilterCount(self.batch_size) if sampling.type == "filter" else None
        filtered: list[Group] = []  # consumed, their places given back
        with operation("wait_for_batch"):
            await fire_fault("wait_for_batch")
            while len(groups) < self.batch_size:
                if count is not None and count.seen >= sampling.max_rounds * self.batch_size:
                    break  # dynamic sampling's bound: train on what there is
                group = await self._receive.receive()
                if staleness(step, group.policy_step) > self.max_staleness:
                    dropped += 1
                    self.prompts.requeue(group.key)
                    self.admission.release()
                    continue
                self.prompts.trained(group.key)
                if count is not None:
                    count.seen += 1
                    if not is_informative(self.ctx, group.output.trajectories):
                        filtered.append(group)
                        self.admission.release()  # another group may start in its place
                        continue
                    count.kept += 1
                groups.append(group)
        filter_metrics: dict[str, float] = {}
        if count is not None:
            exhausted = len(groups) < self.batch_size
            if exhausted:
                log.warning(
                    "step %d: dynamic sampling found %d of %d informative groups in %d taken "
                    "(algorithm.dynamic_sampling.max_rounds); training on %s",
                    step,
                    len(groups),
                    self.batch_size,
                    count.seen,
                    "those" if groups else "the last groups taken, which teach nothing",
                )
            if not groups:
                groups = filtered[-self.batch_size :]
                self.admission.count_again(len(groups))  # trained after all
            filter_metrics = count.metrics(exhausted)
        if dropped:
            log.info("step %d dropped %d groups older than the staleness bound", step, dropped)
        groups.sort(
            key=lambda g: g.key
        )  # the batch's order is the data order, not the finish order
        ages = [staleness(step, g.policy_step) for g in groups]
        self._count_waiting(0)
        workers = self.ctx.cfg.generator.num_parallel_workers
        window = max(self._last_change - self._mark, 1e-9) * workers
        idle = min(self._idle_s / window, 1.0)
        self._idle_s, self._mark = 0.0, self._last_change
        timed_out, self._timed_out = self._timed_out, 0
        return groups, {
            "async/staleness_mean": statistics.fmean(ages),
            "async/staleness_max": float(max(ages)),
            "async/dropped_stale": float(dropped),
            "async/rollouts_timed_out": float(timed_out),
            "async/buffer_size": float(self._receive.statistics().current_buffer_used),
            "async/generator_idle_ratio": idle,
        } | filter_metrics
