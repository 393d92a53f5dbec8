"""``open_owner_nursery``: a nursery's failure surfaces as the error itself, never as a bare group."""

from __future__ import annotations

import pytest
import trio

from trainer.errors import StepTimeoutError
from trainer.vocabulary import open_owner_nursery, step_deadline


async def _fail(exc: BaseException) -> None:
    """Raise at once, with no checkpoint: every task started together fails before any
    cancellation can reach it (as rollouts hit by the same fault at once do)."""
    raise exc


async def test_one_failing_task_is_raised_as_itself_and_cancels_its_siblings():
    cancelled = []

    async def sibling() -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled.append(True)
            raise

    with pytest.raises(KeyError) as info:
        async with open_owner_nursery() as nursery:
            nursery.start_soon(sibling)
            nursery.start_soon(_fail, KeyError("k"))
    assert not isinstance(info.value, BaseExceptionGroup) and cancelled == [True]
    assert not getattr(info.value, "__notes__", None)


async def test_the_same_error_in_many_tasks_is_one_error_with_a_count():
    with pytest.raises(ValueError, match="boom") as info:
        async with open_owner_nursery() as nursery:
            for _ in range(5):
                nursery.start_soon(_fail, ValueError("boom"))
    assert info.value.__notes__ == ["(the same error in 4 more concurrent tasks)"]
    assert not isinstance(info.value.__cause__, BaseExceptionGroup)


async def test_different_errors_at_once_raise_the_first_caused_by_the_whole_group():
    with pytest.raises((ValueError, KeyError)) as info:
        async with open_owner_nursery() as nursery:
            nursery.start_soon(_fail, ValueError("boom"))
            nursery.start_soon(_fail, KeyError("other"))
    assert info.value.__notes__ == ["(1 more concurrent errors; see the cause)"]
    group = info.value.__cause__
    assert isinstance(group, BaseExceptionGroup) and len(group.exceptions) == 2


async def test_a_deadline_over_many_tasks_is_its_own_error_with_no_count(autojump_clock):
    # every task is cancelled by the deadline: no "more concurrent errors" note pointing at
    # a cause the deadline's error does not carry
    with pytest.raises(StepTimeoutError) as info:
        with step_deadline(3, 10):
            async with open_owner_nursery() as nursery:
                for _ in range(15):
                    nursery.start_soon(trio.sleep_forever)
    assert not getattr(info.value, "__notes__", None)


async def test_only_cancellations_raise_one_cancelled_that_keeps_every_cleanup_note(
    autojump_clock,
):
    async def noted(note: str) -> None:
        try:
            await trio.sleep_forever()
        except trio.Cancelled as exc:
            exc.add_note(note)
            raise

    with trio.move_on_after(1) as scope:
        try:
            async with open_owner_nursery() as nursery:
                nursery.start_soon(noted, "cleanup '/resume' skipped")
                nursery.start_soon(noted, "cleanup '/wake_up' skipped")
                nursery.start_soon(trio.sleep_forever)
        except trio.Cancelled as exc:
            assert sorted(exc.__notes__) == [
                "cleanup '/resume' skipped",
                "cleanup '/wake_up' skipped",
            ]
            raise
    assert scope.cancelled_caught
