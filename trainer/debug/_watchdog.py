"""The hang watchdog: a step that runs far longer than usual writes a dump, once.

::

    watchdog = Watchdog(dumper, step_timeout_s=cfg.trainer.step_timeout_s)
    await nursery.start(watchdog.run)          # a task of the run
    with watchdog.watching(step), step_deadline(step, budget):
        await run_step(ctx, step)

When step N has run longer than ``after_s`` (default: ``factor`` x the median duration of the
steps so far, at least ``min_s``; until a step has finished, ``first_step_s``: a first step
loads, compiles and warms up, and is judged by that measure, not by later steps'), one line
goes to the ``trainer.debug`` logger at WARNING (``train.log`` and stderr): how long the step
has run, and the operation that has gone longest without running, with how long
(:func:`~trainer.debug._render.stalest_line`). The whole task tree (:meth:`Dumper.snapshot`)
goes at INFO, to ``train.log`` only; ``python -m trainer debug dump RUN_DIR`` shows it live.
Once per step; nothing is stopped or cancelled.

With a ``step_timeout_s``, the watchdog also takes a snapshot shortly before the step's
deadline (:data:`LAST_WORDS_MARGIN_S`, or a tenth of the budget when that is smaller), while
every task is still where it waits, and :meth:`Watchdog.watching` writes it, whole, at
WARNING (the console too: the step is failing) just before the ``StepTimeoutError`` leaves the
step. All times are on the trio clock.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import trio

from trainer.debug._render import render, stalest_line, where_line
from trainer.debug._snapshot import Dumper, Snapshot
from trainer.errors import StepTimeoutError

__all__ = [
    "DEFAULT_FACTOR",
    "DEFAULT_FIRST_STEP_S",
    "DEFAULT_MIN_S",
    "LAST_WORDS_MARGIN_S",
    "Watchdog",
]

log = logging.getLogger("trainer.debug")

#: The automatic threshold: this many times the median step so far...
DEFAULT_FACTOR = 5.0
#: ...and never less than this many seconds.
DEFAULT_MIN_S = 60.0
#: The threshold until a step has finished (model loading, compilation and warm-up included).
DEFAULT_FIRST_STEP_S = 300.0
#: How long before a step's deadline its last snapshot is taken (at most).
LAST_WORDS_MARGIN_S = 3.0


@attrs.define(eq=False)
class _Step:
    step: int
    #: trio time at which the step started.
    start: float
    #: The watcher's waits for this step; cancelled when the step ends.
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    #: The snapshot taken just before the step's deadline.
    last_words: Snapshot | None = None


@attrs.define(eq=False)
class Watchdog:
    """Watches the running step; see the module docstring."""

    dumper: Dumper
    #: Seconds a step may run before the dump (None: automatic, see ``factor``/``min_s``).
    after_s: float | None = None
    min_s: float = DEFAULT_MIN_S
    factor: float = DEFAULT_FACTOR
    #: The threshold until a step has finished (after_s=None).
    first_step_s: float = DEFAULT_FIRST_STEP_S
    #: The step's budget (``trainer.step_timeout_s``): a last snapshot is taken before it.
    step_timeout_s: float | None = None
    #: False: :meth:`run` returns at once; steps are still tracked for dumps.
    enabled: bool = True
    _durations: list[float] = attrs.Factory(list)
    _running: _Step | None = None
    _step_started: trio.Event = attrs.Factory(trio.Event)

    def __attrs_post_init__(self) -> None:
        self.dumper.running_step = self.running_step  # dumps say which step runs, and how long

    def threshold_s(self) -> float:
        """Seconds the next step may run before the dump."""
        if self.after_s is not None:
            return self.after_s
        if not self._durations:
            return max(self.min_s, self.first_step_s)
        return max(self.min_s, self.factor * statistics.median(self._durations))

    def running_step(self) -> tuple[int, float] | None:
        """(step, seconds it has run) of the step in progress; None between steps."""
        running = self._running
        if running is None:
            return None
        return running.step, trio.current_time() - running.start

    @contextmanager
    def watching(self, step: int) -> Iterator[None]:
        """Step ``step`` runs inside: the watchdog times it.

        A ``StepTimeoutError`` leaving the block is preceded by the dump of the step's last
        moments (or, if that snapshot was not ready, one taken now). The step's duration
        counts towards the median only when it finished.
        """
        current = _Step(step, trio.current_time())
        self._running = current
        self._step_started.set()
        try:
            yield
        except StepTimeoutError as exc:
            snapshot = current.last_words or self.dumper.local()
            log.warning(
                "step %d is about to fail with %s; where it was before its deadline: %s\n%s",
                step,
                type(exc).__name__,
                where_line(snapshot),
                render(snapshot),
            )
            raise
        else:
            self._durations.append(trio.current_time() - current.start)
        finally:
            current.scope.cancel()
            self._running = None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch each step in turn until cancelled (a task of the run's nursery).

        A failing snapshot is logged and the watch goes on: the watchdog never ends a run.
        """
        task_status.started()
        if not self.enabled:
            return
        while True:
            await self._step_started.wait()
            self._step_started = trio.Event()
            current = self._running
            if current is None:  # it already finished
                continue
            with current.scope:
                await self._watch(current)

    async def _watch(self, current: _Step) -> None:
        overdue_at = current.start + self.threshold_s()
        last_words_at = math.inf
        if self.step_timeout_s is not None:
            margin = min(LAST_WORDS_MARGIN_S, self.step_timeout_s / 10)
            last_words_at = current.start + self.step_timeout_s - margin
        if overdue_at < last_words_at:
            await trio.sleep_until(overdue_at)
            snapshot = await self._snapshot()
            if snapshot is not None:
                log.warning(
                    "step %d has run %.1fs, past the watchdog's %.1fs (trainer.watchdog); %s. "
                    "Nothing is stopped; the task tree is in train.log (live: python -m "
                    "trainer debug dump %s)",
                    current.step,
                    trio.current_time() - current.start,
                    overdue_at - current.start,
                    stalest_line(snapshot),
                    self.dumper.run_dir,
                )
                log.info(
                    "step %d's task tree past the watchdog's %.1fs: %s\n%s",
                    current.step,
                    overdue_at - current.start,
                    where_line(snapshot),
                    render(snapshot),
                )
        if math.isfinite(last_words_at):
            await trio.sleep_until(last_words_at)
            current.last_words = await self._snapshot()
        await trio.sleep_forever()

    async def _snapshot(self) -> Snapshot | None:
        try:
            return await self.dumper.snapshot()
        except Exception:
            log.warning("watchdog: the snapshot failed", exc_info=True)
            return None
