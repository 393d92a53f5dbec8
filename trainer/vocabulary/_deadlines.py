"""Deadlines as trio cancel scopes (DESIGN 3 rules 3 and 5).

``step_deadline(step, budget_s, error_cls)`` bounds a block; on expiry it raises
``error_cls(step, budget_s, elapsed_s, stage, operation)``. A nested deadline can only
shorten its parent: when the parent expires first (or at the same instant) the parent's
scope catches the cancellation and the parent's error class is raised. The typed error is
built in one place (:meth:`_Deadline.error`), whoever raises it: the deadline's own scope,
a thread wait that timed out (:func:`wait_result`), or a transfer that had to finish first
(:func:`pending_deadline_error`).

:func:`bounded` is the same kind of scope for work that is given up rather than failed (a
fully-async rollout past ``generator.rollout_timeout_s``): ``trio.move_on_after`` that also
says where the block was waiting when its bound cut it off.
"""

from __future__ import annotations

import contextvars
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import attrs
import trio

from trainer.errors import StepTimeoutError
from trainer.vocabulary._context import AWAIT, at_step, watching, where

__all__ = [
    "Bound",
    "bounded",
    "current_deadline",
    "pending_deadline_error",
    "remaining",
    "step_deadline",
    "wait_result",
]

T = TypeVar("T")


@attrs.define(eq=False)
class _Deadline:
    step: int
    budget_s: float
    error_cls: type[StepTimeoutError]
    scope: trio.CancelScope
    #: trio clock at entry, and ``time.monotonic()`` at entry (threads have no trio clock).
    start: float
    start_mono: float
    #: (stage, operation) innermost when this deadline's cancellation unwound the context.
    hit_at: tuple[str | None, str] | None = None

    @property
    def deadline(self) -> float:
        return self.start + self.budget_s

    def unwinding(self, stage: str | None, operation: str) -> None:
        # Only the trio thread can read the scope; a worker thread's driver records it.
        if self.hit_at is None and trio.lowlevel.in_trio_run() and self.scope.cancel_called:
            self.hit_at = (stage, operation)

    def error(
        self, stage: str | None, operation: str | None, detail: str | None = None
    ) -> StepTimeoutError:
        """This deadline's typed error, naming ``stage`` and ``operation``."""
        elapsed = trio.current_time() - self.start
        return self.error_cls(self.step, self.budget_s, elapsed, stage, operation or AWAIT, detail)


_deadlines: contextvars.ContextVar[tuple[_Deadline, ...]] = contextvars.ContextVar(
    "trainer_deadlines", default=()
)


def _cancelled_notes(exc: BaseException) -> list[str]:
    """Notes that cleanup added to the ``Cancelled`` a deadline is about to swallow."""
    if isinstance(exc, BaseExceptionGroup):
        return [n for e in exc.exceptions for n in _cancelled_notes(e)]
    if isinstance(exc, trio.Cancelled):
        return list(getattr(exc, "__notes__", ()))
    return []


@contextmanager
def step_deadline(
    global_step: int,
    budget_s: float | None,
    error_cls: type[StepTimeoutError] = StepTimeoutError,
) -> Iterator[None]:
    """Bound the enclosed block by ``budget_s`` seconds; raise ``error_cls`` on expiry.

    ``None`` means no bound (the step number is still made current). A nested deadline can
    only shorten its parent: if the parent's deadline comes first, or at the same instant,
    the parent's scope takes the cancellation and the parent's ``error_cls`` is raised.
    The error names the innermost stage and operation open at expiry.
    """
    with at_step(global_step):
        if budget_s is None:
            yield
            return
        now = trio.current_time()
        scope = trio.CancelScope(deadline=now + budget_s)
        d = _Deadline(global_step, budget_s, error_cls, scope, now, time.monotonic())
        token = _deadlines.set((*_deadlines.get(), d))
        notes: list[str] = []
        try:
            with scope, watching(d):
                try:
                    yield
                except BaseException as exc:
                    notes = _cancelled_notes(exc)
                    raise
        finally:
            _deadlines.reset(token)
        if scope.cancelled_caught:
            error = d.error(*(d.hit_at or (where()[0], AWAIT)))
            # e.g. "cleanup '/resume' skipped": added to the Cancelled this scope swallowed.
            for note in notes:
                error.add_note(note)
            raise error from None


@attrs.define(eq=False)
class Bound:
    """What :func:`bounded` saw of its block: whether the bound cut it off, and where."""

    budget_s: float | None
    scope: trio.CancelScope
    #: trio clock at entry.
    start: float
    #: (stage, operation) innermost when the bound's cancellation unwound the block.
    hit_at: tuple[str | None, str] | None = None

    @property
    def expired(self) -> bool:
        """The bound cut the block off (not a cancellation from outside, not an error)."""
        return self.scope.cancelled_caught

    @property
    def elapsed_s(self) -> float:
        return trio.current_time() - self.start

    def unwinding(self, stage: str | None, operation: str) -> None:
        if self.hit_at is None and trio.lowlevel.in_trio_run() and self.scope.cancel_called:
            self.hit_at = (stage, operation)


@contextmanager
def bounded(budget_s: float | None) -> Iterator[Bound]:
    """Cancel the enclosed block after ``budget_s`` seconds and carry on after it.

    ``trio.move_on_after`` with a record: :attr:`Bound.expired` says whether the bound cut
    the block off, :attr:`Bound.hit_at` the innermost (stage, operation) open then (in the
    block's own task or the tasks it started). ``None`` means no bound. It is not a step
    deadline: it raises nothing, and an enclosing deadline that fires first (or a
    cancellation from outside) propagates as usual, with ``expired`` false.
    """
    scope = trio.CancelScope()
    bound = Bound(budget_s, scope, trio.current_time())
    if budget_s is not None:
        scope.deadline = bound.start + budget_s
    with scope, watching(bound):
        yield bound
    if bound.expired and bound.hit_at is None:
        bound.hit_at = (where()[0], AWAIT)


def _effective() -> _Deadline | None:
    """The deadline that will fire first (ties go to the outer one, as trio resolves them)."""
    best: _Deadline | None = None
    for d in _deadlines.get():
        if best is None or d.deadline < best.deadline:
            best = d
    return best


def current_deadline() -> float:
    """The trio-clock time at which the innermost effective deadline fires; ``inf`` if none."""
    d = _effective()
    return math.inf if d is None else d.deadline


def remaining() -> float | None:
    """Seconds left before the innermost effective step deadline; ``None`` when unbounded.

    Never negative. Works on the trio thread and in threads started with ``trio.to_thread``
    (there it is measured with ``time.monotonic`` from the deadline's start).
    """
    ds = _deadlines.get()
    if not ds:
        return None
    if trio.lowlevel.in_trio_run():
        now = trio.current_time()
        left = min(d.deadline - now for d in ds)
    else:  # a worker thread
        mono = time.monotonic()
        left = min(d.budget_s - (mono - d.start_mono) for d in ds)
    return max(0.0, left)


def pending_deadline_error(
    cause: BaseException | None, operation: str, detail: str | None = None
) -> StepTimeoutError | None:
    """The typed error of the deadline whose cancellation is pending, chained to ``cause``.

    For code that had to finish (a shielded transfer) after its deadline fired: the error
    names the current stage and ``operation``, and ``detail`` says what was done about it.
    ``None`` when no deadline has fired (the cancellation came from elsewhere). Of several
    that fired while the shielded code ran, the one that fired first (a weight sync's
    budget before its step's); ties go to the parent.
    """
    fired: _Deadline | None = None
    for d in _deadlines.get():  # outermost first: a later one must fire strictly earlier
        if d.scope.cancel_called and (fired is None or d.deadline < fired.deadline):
            fired = d
    if fired is None:
        return None
    error = fired.error(where()[0], operation, detail)
    error.__cause__ = cause
    return error


async def wait_result(
    get: Callable[[float | None], T],
    *,
    timeout_errors: tuple[type[BaseException], ...] = (TimeoutError,),
) -> T:
    """Run blocking ``get(timeout)`` in a thread with ``timeout=remaining()``.

    If ``get`` raises one of ``timeout_errors`` after being given a finite timeout, that is
    this deadline expiring: the deadline's own error (class, step, stage, operation) is
    raised, chained to it. Without a deadline ``get(None)`` waits unbounded and any error
    passes through unchanged. The thread is abandoned if the step is cancelled, so a hung
    ``get`` never outlives the driver's wait.
    """
    budget = remaining()
    try:
        return await trio.to_thread.run_sync(get, budget, abandon_on_cancel=True)
    except timeout_errors as exc:
        d = _effective()
        if budget is None or d is None:
            raise
        raise d.error(*where()) from exc
