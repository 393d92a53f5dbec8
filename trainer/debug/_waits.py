"""How long each trio task has waited: the time it last yielded to the scheduler.

``WaitClock`` is a trio instrument: after every task step it notes the time on the trio
clock (so tests can run it under ``MockClock``), and a dump can say "this task has been
waiting 93 s". The cost is one dict store per task step; a task that exits is forgotten.
"""

from __future__ import annotations

import trio

__all__ = ["WaitClock"]


class WaitClock(trio.abc.Instrument):
    """The trio time at which each live task last yielded (see :meth:`waited_s`)."""

    def __init__(self) -> None:
        self._yielded: dict[trio.lowlevel.Task, float] = {}

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        self._yielded[task] = trio.current_time()

    def task_exited(self, task: trio.lowlevel.Task) -> None:
        self._yielded.pop(task, None)

    def waited_s(self, task: trio.lowlevel.Task, now: float | None = None) -> float | None:
        """Seconds since ``task`` last yielded (``now`` defaults to ``trio.current_time()``);
        None if it has not run since the clock was installed. Call it on the trio thread."""
        yielded = self._yielded.get(task)
        if yielded is None:
            return None
        return max(0.0, (trio.current_time() if now is None else now) - yielded)
