"""Waits on Ray refs, off the trio thread, bounded by the step's remaining budget (rule 5)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from trainer.vocabulary._deadlines import wait_result

__all__ = ["OnFailure", "get_refs_as_completed", "wait_refs"]

#: ``on_failure(index, error)``: the error to raise for the ``index``-th ref failing with
#: ``error`` (a ``RayError``); each caller knows which actor that is and raises its own.
OnFailure = Callable[[int, BaseException], BaseException]


def _as_is(index: int, error: BaseException) -> BaseException:
    return error


def get_refs_as_completed(
    refs: Sequence[object], timeout: float | None, on_failure: OnFailure = _as_is
) -> list[Any]:
    """Blocking ``ray.get`` of every ref, failing on the first error in completion order.

    A dead actor is reported as soon as its ref fails, even while its peers still block
    (in a collective waiting for it, say). Raises ``ray.exceptions.GetTimeoutError`` when
    not every ref is ready within ``timeout`` seconds (``None``: unbounded), and
    ``on_failure(index, error)`` for the ref that failed (by default its own ``RayError``).
    """
    import ray  # Ray is heavy and only runs that use it pay for importing it
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
                raise on_failure(index[ref], exc) from None
    return results


async def wait_refs(refs: Sequence[object], on_failure: OnFailure = _as_is) -> list[Any]:
    """Every ref's value, awaited off the trio thread with ``timeout=remaining()`` (rule 5).

    The deadline expiring while a ref is pending raises the deadline's own error (step,
    stage, operation); a failed ref raises ``on_failure(index, error)``.
    """
    from ray.exceptions import GetTimeoutError

    return await wait_result(
        lambda timeout: get_refs_as_completed(refs, timeout, on_failure),
        timeout_errors=(GetTimeoutError,),
    )
