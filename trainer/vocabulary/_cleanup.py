"""Failure-path cleanup with what is left of the step's budget (DESIGN 3 rule 7)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import trio

from trainer.vocabulary._deadlines import current_deadline

__all__ = ["cleanup_bracket", "cleanup_preserving_primary"]

log = logging.getLogger("trainer.cleanup")


def _note(primary: BaseException, msg: str) -> None:
    log.warning(msg)
    primary.add_note(msg)


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
    deadline = current_deadline()
    if trio.current_time() >= deadline:
        _note(primary, f"cleanup {label!r} skipped: the step deadline had already passed")
        return
    with trio.CancelScope(shield=True, deadline=deadline) as scope:
        try:
            await cleanup()
        except Exception as exc:
            _note(primary, f"cleanup {label!r} also failed: {type(exc).__name__}: {exc}")
            return
    if scope.cancelled_caught:
        _note(primary, f"cleanup {label!r} was cut off at the step deadline")


@asynccontextmanager
async def cleanup_bracket(
    cleanup: Callable[[], Awaitable[object]], label: str
) -> AsyncIterator[None]:
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
