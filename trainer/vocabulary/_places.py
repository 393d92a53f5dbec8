"""Where another task is: its step, stage, operation and deadline, read from its context.

A debugger walking the trio task tree holds each task's ``contextvars.Context``
(``task.context``); :func:`place_of` reads the vocabulary's variables through it, so the
task itself is not disturbed and need not be running.
"""

from __future__ import annotations

import contextvars
import math
import time

import attrs
import trio

from trainer.vocabulary._context import _operation, _stage, _step
from trainer.vocabulary._deadlines import _deadlines

__all__ = ["Place", "place_of"]


@attrs.frozen
class Place:
    """The step, stage, operation and deadline seen by the code running in one context."""

    #: The global step (``None`` outside ``step_deadline``/``at_step``).
    step: int | None
    #: The innermost open stage, or ``None``.
    stage: str | None
    #: The innermost open operation, or ``None`` (an error would say ``'await'``).
    operation: str | None
    #: The budget of the deadline that fires first (``None``: no deadline).
    budget_s: float | None = None
    #: Seconds left before it fires, never negative (``None``: no deadline).
    remaining_s: float | None = None
    #: The error class that deadline raises (``'StepTimeoutError'``...), or ``None``.
    deadline_error: str | None = None


def place_of(context: contextvars.Context) -> Place:
    """The :class:`Place` of the code running in ``context`` (a task's ``task.context``).

    On the trio thread the remaining budget is measured on the trio clock; elsewhere with
    ``time.monotonic`` from the deadline's start. Reads only: never blocks, never raises.
    """
    place = Place(context.get(_step), context.get(_stage), context.get(_operation))
    deadlines = context.get(_deadlines, ())
    if not deadlines:
        return place
    first = min(deadlines, key=lambda d: d.deadline)
    if trio.lowlevel.in_trio_run():
        left = first.deadline - trio.current_time()
    else:
        left = first.budget_s - (time.monotonic() - first.start_mono)
    return attrs.evolve(
        place,
        budget_s=first.budget_s,
        remaining_s=max(0.0, left) if math.isfinite(left) else None,
        deadline_error=first.error_cls.__name__,
    )
