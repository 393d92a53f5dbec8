"""Deadlines as trio cancel scopes, and the stage/operation context that names a hang.

- ``step_deadline(step, budget_s, error_cls)`` bounds a block; on expiry it raises
  ``error_cls(step, budget_s, elapsed_s, stage, operation)``. A nested deadline can only
  shorten its parent: when the parent expires first (or at the same instant) the parent's
  scope catches the cancellation and the parent's error class is raised.
- ``stage(name)`` / ``operation(name)`` (and ``Timer(name)``, which enters ``stage(name)``)
  live in ``contextvars``, so threads started with ``trio.to_thread.run_sync`` see them.
  On expiry the innermost open stage and operation are recorded into the expiring
  deadline before the context unwinds; ``operation='await'`` when none was open.
- ``remaining()`` is the time left before the innermost effective deadline (``None`` if
  unbounded); it works on the trio thread and in threads started from it.
- ``wait_result(get)`` runs a blocking ``get(timeout)`` (a future's ``result``, ``ray.get``)
  in a thread with ``timeout=remaining()`` and turns *its* timeout into the deadline's error.
- ``wait_refs(refs)`` is ``wait_result`` for Ray: every ref's value, in order, failing with
  :class:`RefFailed` on the first ref that fails, in completion order.
- ``cleanup_preserving_primary`` runs failure-path cleanup shielded, bounded by the step's
  deadline, without ever replacing the primary error.
"""

from __future__ import annotations

import contextvars
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any, TypeVar

import attrs
import trio

from trainer.errors import StepTimeoutError

__all__ = [
    "RefFailed",
    "Timer",
    "cleanup_bracket",
    "cleanup_preserving_primary",
    "current_operation",
    "current_stage",
    "current_step",
    "open_owner_nursery",
    "operation",
    "remaining",
    "stage",
    "step_deadline",
    "wait_refs",
    "wait_result",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

#: Fallback operation name when a deadline expires with no ``operation()`` open.
AWAIT = "await"


@attrs.define(eq=False)
class _Deadline:
    step: int
    budget_s: float
    error_cls: type[StepTimeoutError]
    scope: trio.CancelScope
    #: trio clock at entry, and ``time.monotonic()`` at entry (for threads, which have no trio clock).
    start: float
    start_mono: float
    #: (stage, operation) innermost when this deadline's cancellation unwound the context.
    where: tuple[str | None, str] | None = None

    @property
    def deadline(self) -> float:
        return self.start + self.budget_s

    def make_error(self, stage_name: str | None, op: str | None) -> StepTimeoutError:
        elapsed = trio.current_time() - self.start
        return self.error_cls(self.step, self.budget_s, elapsed, stage_name, op or AWAIT)


_deadlines: contextvars.ContextVar[tuple[_Deadline, ...]] = contextvars.ContextVar(
    "trainer_deadlines", default=()
)
_stage: contextvars.ContextVar[str | None] = contextvars.ContextVar("trainer_stage", default=None)
_operation: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "trainer_operation", default=None
)
_step: contextvars.ContextVar[int | None] = contextvars.ContextVar("trainer_step", default=None)


def current_stage() -> str | None:
    """The innermost open stage, or ``None``."""
    return _stage.get()


def current_operation() -> str | None:
    """The innermost open operation, or ``None``."""
    return _operation.get()


def current_step() -> int | None:
    """The global step of the innermost ``step_deadline`` (set even when its budget is None)."""
    return _step.get()


def _record_where() -> None:
    """Called when a stage/operation unwinds with an exception: remember where expired deadlines hit."""
    if not trio.lowlevel.in_trio_run():
        # A worker thread (stage/operation also name work done there): it cannot read the
        # scope's state, and the driver's own wait records where it was when it unwinds.
        return
    for d in _deadlines.get():
        if d.where is None and d.scope.cancel_called:
            d.where = (_stage.get(), _operation.get() or AWAIT)


def _cancelled_notes(exc: BaseException) -> list[str]:
    """Notes that cleanup added to the ``Cancelled`` a deadline is about to swallow."""
    if isinstance(exc, BaseExceptionGroup):
        return [n for e in exc.exceptions for n in _cancelled_notes(e)]
    if isinstance(exc, trio.Cancelled):
        return list(getattr(exc, "__notes__", ()))
    return []


@contextmanager
def stage(name: str) -> Iterator[None]:
    """Name the stage of the step that the enclosed code belongs to (see DESIGN 4.3)."""
    token = _stage.set(name)
    try:
        yield
    except BaseException:
        _record_where()
        raise
    finally:
        _stage.reset(token)


@contextmanager
def operation(name: str) -> Iterator[None]:
    """Name the awaited call (``forward_backward``, ``/pause``, ...) that the enclosed code makes."""
    token = _operation.set(name)
    try:
        yield
    except BaseException:
        _record_where()
        raise
    finally:
        _operation.reset(token)


class Timer:
    """``with Timer("generate", timings):`` enters ``stage("generate")`` and records its seconds.

    ``timings[name]`` receives the wall seconds spent in the block, even when it raises.
    """

    def __init__(self, name: str, timings: dict[str, float] | None = None) -> None:
        self.name = name
        self.timings = timings if timings is not None else {}
        self.elapsed_s = 0.0
        self._cm = stage(name)
        self._t0 = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        self._cm.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._cm.__exit__(*exc)  # type: ignore[arg-type]
        finally:
            self.elapsed_s = time.perf_counter() - self._t0
            self.timings[self.name] = self.elapsed_s


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
    step_token = _step.set(global_step)
    try:
        if budget_s is None:
            yield
            return
        now = trio.current_time()
        scope = trio.CancelScope(deadline=now + budget_s)
        d = _Deadline(global_step, budget_s, error_cls, scope, now, time.monotonic())
        token = _deadlines.set((*_deadlines.get(), d))
        notes: list[str] = []
        try:
            with scope:
                try:
                    yield
                except BaseException as exc:
                    notes = _cancelled_notes(exc)
                    raise
        finally:
            _deadlines.reset(token)
        if scope.cancelled_caught:
            stage_name, op = d.where or (_stage.get(), AWAIT)
            error = d.make_error(stage_name, op)
            # e.g. "cleanup '/resume' skipped": added to the Cancelled this scope swallowed.
            for note in notes:
                error.add_note(note)
            raise error from None
    finally:
        _step.reset(step_token)


def _effective() -> _Deadline | None:
    """The deadline that will fire first (ties go to the outer one, as trio resolves them)."""
    best: _Deadline | None = None
    for d in _deadlines.get():
        if best is None or d.deadline < best.deadline:
            best = d
    return best


def remaining() -> float | None:
    """Seconds left before the innermost effective step deadline; ``None`` when unbounded.

    Never negative. Works on the trio thread and in threads started with ``trio.to_thread``
    (there it is measured with ``time.monotonic`` from the deadline's start).
    """
    ds = _deadlines.get()
    if not ds:
        return None
    try:
        now = trio.current_time()
        left = min(d.deadline - now for d in ds)
    except RuntimeError:  # not on the trio thread: a worker thread
        mono = time.monotonic()
        left = min(d.budget_s - (mono - d.start_mono) for d in ds)
    return max(0.0, left)


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
        raise d.make_error(_stage.get(), _operation.get()) from exc


class RefFailed(Exception):
    """``wait_refs``: the ``index``-th ref failed with ``error`` (a ``ray.exceptions.RayError``).

    Callers translate it into their own typed error, knowing which actor ``index`` is.
    """

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(index, error)
        self.index = index
        self.error = error


def get_refs_as_completed(refs: Sequence[Any], timeout: float | None) -> list[Any]:
    """Blocking ``ray.get`` of every ref, failing on the first error in completion order.

    A dead actor is reported as soon as its ref fails, even while its peers still block
    (in a collective waiting for it, say). Raises ``ray.exceptions.GetTimeoutError`` when
    not every ref is ready within ``timeout`` seconds (``None``: unbounded).
    """
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    end = None if timeout is None else time.monotonic() + timeout
    index = {ref: i for i, ref in enumerate(refs)}
    results: list[Any] = [None] * len(refs)
    pending = list(refs)
    while pending:
        left = None if end is None else max(0.0, end - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            raise GetTimeoutError(f"{len(pending)} result(s) not ready after {timeout}s")
        for ref in ready:
            try:
                results[index[ref]] = ray.get(ref)
            except RayError as exc:
                raise RefFailed(index[ref], exc) from None
    return results


async def wait_refs(refs: Sequence[Any]) -> list[Any]:
    """Every ref's value, awaited off the trio thread with ``timeout=remaining()`` (rule 5).

    The deadline expiring while a ref is pending raises the deadline's own error (step,
    stage, operation); a failed ref raises :class:`RefFailed`.
    """
    from ray.exceptions import GetTimeoutError

    return await wait_result(
        lambda timeout: get_refs_as_completed(refs, timeout), timeout_errors=(GetTimeoutError,)
    )


def _cleanup_deadline() -> float:
    d = _effective()
    return math.inf if d is None else d.deadline


async def cleanup_preserving_primary(
    primary: BaseException,
    cleanup: Callable[[], Awaitable[object]],
    label: str,
) -> None:
    """Run failure-path ``cleanup`` without replacing ``primary``.

    The cleanup runs shielded from the cancellation that is unwinding, bounded by the
    step's deadline: once that has passed it is skipped with a warning; if it runs past it,
    it is cut off. Skips, cut-offs and cleanup failures become notes on ``primary``.
    Without a deadline the cleanup is unbounded.
    """
    deadline = _cleanup_deadline()
    if trio.current_time() >= deadline:
        msg = f"cleanup {label!r} skipped: the step deadline had already passed"
        log.warning(msg)
        primary.add_note(msg)
        return
    with trio.CancelScope(shield=True, deadline=deadline) as scope:
        try:
            await cleanup()
        except Exception as exc:
            msg = f"cleanup {label!r} also failed: {type(exc).__name__}: {exc}"
            log.warning(msg)
            primary.add_note(msg)
            return
    if scope.cancelled_caught:
        msg = f"cleanup {label!r} was cut off at the step deadline"
        log.warning(msg)
        primary.add_note(msg)


@asynccontextmanager
async def cleanup_bracket(cleanup: Callable[[], Awaitable[object]], label: str):
    """``async with cleanup_bracket(resume, "/resume"):`` — ``resume`` always runs after the body.

    On success it runs normally (inside the caller's deadline); on failure or cancellation
    it runs through :func:`cleanup_preserving_primary` and the body's error propagates.
    """
    try:
        yield
    except BaseException as primary:
        await cleanup_preserving_primary(primary, cleanup, label)
        raise
    await cleanup()


@asynccontextmanager
async def open_owner_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose failure surfaces as the typed error itself, not an ExceptionGroup.

    trio wraps every error leaving a nursery in an ``ExceptionGroup``. Where one error is
    the usual outcome (the body failed, or one child task did), this re-raises that error
    with its own traceback and cause. When several tasks failed at once, the first is
    raised with the whole group as its ``__cause__`` and a note counting the others.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        errors = [e for e in leaves if not isinstance(e, trio.Cancelled)] or leaves
        first = errors[0]
        if len(errors) == 1:
            raise first from first.__cause__
        first.add_note(f"({len(errors) - 1} more concurrent errors; see the cause)")
        raise first from group


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out
