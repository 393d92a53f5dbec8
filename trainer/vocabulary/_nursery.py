"""The owner nursery, and the one way several failures become one error."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import NoReturn

import trio

__all__ = ["leaves", "open_owner_nursery", "raise_first"]


def leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The errors of a (nested) exception group, depth first, in order."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def raise_first(errors: Sequence[BaseException]) -> NoReturn:
    """Raise ``errors[0]``; each of the others becomes a note on it (``also: Type: msg``).

    For fan-outs where every call ran to its end and the first (in a stable order, e.g.
    server index) is the one to report. ``ValueError`` for no errors.
    """
    if not errors:
        raise ValueError("raise_first needs at least one error")
    first = errors[0]
    for other in errors[1:]:
        first.add_note(f"also: {type(other).__name__}: {other}")
    raise first


@asynccontextmanager
async def open_owner_nursery() -> AsyncIterator[trio.Nursery]:
    """A nursery whose failure surfaces as the typed error itself, not an ExceptionGroup.

    trio wraps every error leaving a nursery in an ``ExceptionGroup``. Where one error is
    the usual outcome (the body failed, or one child task did), this re-raises that error
    with its own traceback and cause. So it does when several tasks failed with the same
    error (same type and message: a fault hitting every rollout at once), with a note
    counting the others. When different errors happened at once, the first is raised with
    the whole group as its ``__cause__`` and a note counting the others. When every task
    was cancelled (an outer deadline), one ``Cancelled`` is raised, carrying every note the
    cancellations held and no count.
    """
    try:
        async with trio.open_nursery() as nursery:
            yield nursery
    except BaseExceptionGroup as group:
        found = leaves(group)
        errors = [e for e in found if not isinstance(e, trio.Cancelled)]
        if not errors:
            # only cancellations: an outer scope's (a deadline's), not errors to count; the
            # notes cleanup added to any of them ("cleanup '/resume' skipped") are kept
            first = found[0]
            for other in found[1:]:
                for note in getattr(other, "__notes__", ()):
                    if note not in getattr(first, "__notes__", ()):
                        first.add_note(note)
            raise first from first.__cause__
        first = errors[0]
        if len(errors) == 1:
            raise first from first.__cause__
        if all(_same(e, first) for e in errors[1:]):
            first.add_note(f"(the same error in {len(errors) - 1} more concurrent tasks)")
            raise first from first.__cause__
        first.add_note(f"({len(errors) - 1} more concurrent errors; see the cause)")
        raise first from group


def _same(a: BaseException, b: BaseException) -> bool:
    return type(a) is type(b) and str(a) == str(b)
