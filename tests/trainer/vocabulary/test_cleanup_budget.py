"""Cleanup gets what is left of the budget (DESIGN 3, rule 7): ``cleanup_bracket`` and
``cleanup_preserving_primary`` (trio's MockClock wherever time matters)."""

from __future__ import annotations

import logging

import pytest
import trio
import trio.testing

from trainer.errors import InferenceServerError, StepTimeoutError, WeightSyncTimeoutError
from trainer.vocabulary import (
    Timer,
    cleanup_bracket,
    cleanup_preserving_primary,
    operation,
    step_deadline,
)

# --- cleanup gets what is left of the budget ---------------------------------------------


async def test_cleanup_after_expiry_is_skipped_with_a_warning_and_a_note(autojump_clock, caplog):
    ran: list[str] = []

    async def resume() -> None:
        ran.append("/resume")

    with (
        pytest.raises(WeightSyncTimeoutError) as info,
        step_deadline(2, 10, WeightSyncTimeoutError),
        Timer("sync_weights"),
    ):
        async with cleanup_bracket(resume, "/resume"):
            with operation("/update_weights"):
                await trio.sleep_forever()
    assert ran == []
    note = "cleanup '/resume' skipped: the step deadline had already passed"
    assert info.value.__notes__ == [note]
    assert (info.value.stage, info.value.operation) == ("sync_weights", "/update_weights")
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [note]


async def test_cleanup_that_hangs_after_a_body_error_is_cut_off_at_the_deadline(autojump_clock):
    start = trio.current_time()
    body_error = InferenceServerError("http://127.0.0.1:8001", "/update_weights", 500, "boom")

    async def resume() -> None:
        await trio.sleep_forever()

    with (
        pytest.raises(InferenceServerError) as info,
        step_deadline(4, 30),
        Timer("sync_weights"),
    ):
        async with cleanup_bracket(resume, "/resume"):
            await trio.sleep(5)
            raise body_error
    assert info.value is body_error
    assert info.value.__notes__ == ["cleanup '/resume' was cut off at the step deadline"]
    assert trio.current_time() - start == pytest.approx(30)


async def test_cleanup_runs_shielded_from_the_cancellation_that_unwinds(autojump_clock):
    ran: list[str] = []

    async def wake_up() -> None:
        await trio.sleep(3)
        ran.append("/wake_up")

    with step_deadline(1, 60):
        with trio.move_on_after(1) as scope:  # e.g. a sibling failed and cancelled us
            async with cleanup_bracket(wake_up, "/wake_up"):
                await trio.sleep_forever()
    assert scope.cancelled_caught
    assert ran == ["/wake_up"]


async def test_a_failing_cleanup_adds_a_note_and_keeps_the_primary_error(autojump_clock):
    primary = RuntimeError("transfer failed")

    async def resume() -> None:
        raise InferenceServerError("http://127.0.0.1:8001", "/resume", 503, "sleeping")

    with pytest.raises(RuntimeError) as info, step_deadline(1, 60):
        async with cleanup_bracket(resume, "/resume"):
            raise primary
    assert info.value is primary
    assert info.value.__notes__ == [
        "cleanup '/resume' also failed: InferenceServerError: "
        "/resume on http://127.0.0.1:8001 failed (status 503): sleeping"
    ]


async def test_cleanup_is_unbounded_without_a_deadline(autojump_clock):
    start = trio.current_time()
    primary = RuntimeError("body failed")
    ran: list[str] = []

    async def resume() -> None:
        await trio.sleep(10**5)
        ran.append("/resume")

    await cleanup_preserving_primary(primary, resume, "/resume")
    assert ran == ["/resume"]
    assert not hasattr(primary, "__notes__")
    assert trio.current_time() - start == pytest.approx(10**5)


async def test_cleanup_bracket_runs_cleanup_after_success_and_after_failure():
    log: list[str] = []

    async def resume() -> None:
        log.append("cleanup")

    async with cleanup_bracket(resume, "/resume"):
        log.append("body")
    assert log == ["body", "cleanup"]

    log.clear()
    with pytest.raises(KeyError):
        async with cleanup_bracket(resume, "/resume"):
            log.append("body")
            raise KeyError("x")
    assert log == ["body", "cleanup"]


async def test_cleanup_on_success_is_not_shielded_from_the_deadline(autojump_clock):
    async def resume() -> None:
        with operation("/resume"):
            await trio.sleep_forever()

    with pytest.raises(StepTimeoutError) as info, step_deadline(1, 10), Timer("sync_weights"):
        async with cleanup_bracket(resume, "/resume"):
            pass
    assert info.value.operation == "/resume"


async def test_no_checkpoint_is_added_by_entering_stages_and_operations():
    with (
        trio.testing.assert_no_checkpoints(),
        step_deadline(1, 10),
        Timer("generate"),
        operation("generate"),
    ):
        pass
