"""Where the code is: the step, stage and operation, kept in ``contextvars``.

Threads started with ``trio.to_thread.run_sync`` copy the context, so a worker thread sees
the step, stage and operation of the task that started it (and faults fire on the right
step). When a stage or operation unwinds with an exception, every open watcher (each
``step_deadline``) is told the innermost (stage, operation) first, so a deadline's error
names where the step was waiting, not where the unwinding ended.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import Protocol, TypeVar

from trainer.vocabulary._names import OPERATIONS, STAGES, Operation, Stage

T = TypeVar("T")

__all__ = [
    "AWAIT",
    "Timer",
    "UnwindWatcher",
    "at_step",
    "current_operation",
    "current_stage",
    "current_step",
    "operation",
    "stage",
    "watching",
    "where",
]

#: The operation named when a deadline expires with no ``operation()`` open.
AWAIT = "await"

_STAGES = frozenset(STAGES)
_OPERATIONS = frozenset(OPERATIONS)

_stage: contextvars.ContextVar[str | None] = contextvars.ContextVar("trainer_stage", default=None)
_operation: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "trainer_operation", default=None
)
_step: contextvars.ContextVar[int | None] = contextvars.ContextVar("trainer_step", default=None)


class UnwindWatcher(Protocol):
    def unwinding(self, stage: str | None, operation: str) -> None:
        """A stage or operation is unwinding with an exception at (stage, operation)."""
        ...


_watchers: contextvars.ContextVar[tuple[UnwindWatcher, ...]] = contextvars.ContextVar(
    "trainer_unwind_watchers", default=()
)


def current_stage() -> str | None:
    """The innermost open stage, or ``None``."""
    return _stage.get()


def current_operation() -> str | None:
    """The innermost open operation, or ``None``."""
    return _operation.get()


def current_step() -> int | None:
    """The global step of the innermost ``step_deadline`` or ``at_step`` (None outside one)."""
    return _step.get()


def where() -> tuple[str | None, str]:
    """The innermost (stage, operation); the operation is ``'await'`` when none is open."""
    return _stage.get(), _operation.get() or AWAIT


@contextmanager
def _entered(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    except BaseException:
        here = where()
        for watcher in _watchers.get():
            watcher.unwinding(*here)
        raise
    finally:
        var.reset(token)


def stage(name: Stage) -> AbstractContextManager[None]:
    """Name the stage of the step the enclosed code belongs to (one of ``STAGES``).

    ``ValueError`` for any other name: a misspelt stage would name no real stage in errors
    and metrics.
    """
    if name not in _STAGES:
        raise ValueError(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    return _entered(_stage, name)


def operation(name: Operation | str) -> AbstractContextManager[None]:
    """Name the awaited call the enclosed code makes: one of ``OPERATIONS``, or any other
    control-plane endpoint by its path (``/is_paused``); ``ValueError`` otherwise."""
    if name not in _OPERATIONS and not name.startswith("/"):
        raise ValueError(
            f"unknown operation {name!r}; operations: {', '.join(OPERATIONS)} "
            "or a control-plane path such as '/is_paused'"
        )
    return _entered(_operation, name)


def at_step(step: int | None) -> AbstractContextManager[None]:
    """Make ``step`` current without a deadline (a worker process told the driver's step)."""
    return _entered(_step, step)


@contextmanager
def watching(watcher: UnwindWatcher) -> Iterator[None]:
    """Tell ``watcher`` about every stage or operation that unwinds with an exception inside."""
    token = _watchers.set((*_watchers.get(), watcher))
    try:
        yield
    finally:
        _watchers.reset(token)


class Timer:
    """``with Timer("generate", timings):`` enters ``stage("generate")`` and records its seconds.

    ``timings[name]`` receives the wall seconds spent in the block, even when it raises.
    """

    def __init__(self, name: Stage, timings: dict[str, float] | None = None) -> None:
        self.name = name
        self.timings = timings if timings is not None else {}
        self.elapsed_s = 0.0
        self._cm = stage(name)
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        self._cm.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._cm.__exit__(et, e, tb)
        finally:
            self.elapsed_s = time.perf_counter() - self._t0
            self.timings[self.name] = self.elapsed_s
