"""The event-loop stall instrument.

``StallInstrument`` measures the longest stretch the trio thread spent inside one task step
(from the scheduler handing a task control until the task yields back). A blocking call on
the trio thread — a ``ray.get``, a forward pass, a big ``torch.save`` — shows up here as a
stall as long as the call; with every blocking call pushed off the loop (DESIGN 3.1) stalls
stay in the low milliseconds. The loop reports it per step as ``loop/max_stall_ms``, and
the stretch of one stage (the checkpoint save) through :meth:`StallInstrument.window`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import trio

__all__ = ["StallInstrument", "StallWindow"]


@attrs.define(eq=False)
class StallWindow:
    """The longest stall inside one :meth:`StallInstrument.window` block."""

    max_ms: float = 0.0
    """The longest single task step (ms) seen while the block was open; final once it exits."""


class StallInstrument(trio.abc.Instrument):
    """Tracks the longest single task step since the last :meth:`take_max_ms`."""

    def __init__(self) -> None:
        self._started = 0.0
        self._max_s = 0.0
        self._worst_task = ""
        self._windows: list[StallWindow] = []

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        self._started = time.perf_counter()

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if not self._started:  # installed in the middle of this step: no start time
            return
        elapsed = time.perf_counter() - self._started
        for w in self._windows:
            w.max_ms = max(w.max_ms, elapsed * 1000.0)
        if elapsed > self._max_s:
            self._max_s = elapsed
            self._worst_task = task.name

    @property
    def worst_task(self) -> str:
        """Name of the task that made the longest stall in the current window."""
        return self._worst_task

    def take_max_ms(self) -> float:
        """The longest stall (ms) since the previous call, and start a new window."""
        worst = self._max_s * 1000.0
        self._max_s = 0.0
        self._worst_task = ""
        return worst

    @contextmanager
    def window(self) -> Iterator[StallWindow]:
        """Measure the longest stall while the block runs, beside (not instead of) the step's.

        Task steps that end inside the block count, whichever task made them; the per-step
        maximum (:meth:`take_max_ms`) is unaffected. Windows may nest. On an exception or a
        cancellation the window closes all the same, holding what it saw so far.
        """
        w = StallWindow()
        self._windows.append(w)
        try:
            yield w
        finally:
            self._windows.remove(w)
