"""The hang watchdog writes one dump when a step runs long, never stops it, and writes the
step's last moments just before a step timeout (all on trio's MockClock)."""

from __future__ import annotations

import logging

import pytest
import trio

from trainer.debug import Dumper, Watchdog
from trainer.errors import StepTimeoutError
from trainer.vocabulary import Timer, operation, step_deadline


class TrioTimes(logging.Handler):
    """Records (trio time, message) of each record of the ``trainer.debug`` logger at
    ``level`` or above."""

    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.seen: list[tuple[float, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((trio.current_time(), record.getMessage()))


def _recorded(level: int):
    handler = TrioTimes(level)
    logger = logging.getLogger("trainer.debug")
    old_level = logger.level
    logger.setLevel(logging.INFO)  # as the run sets it (train.log takes INFO)
    logger.addHandler(handler)
    try:
        yield handler.seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)


@pytest.fixture
def dumps():
    """What reaches the console (WARNING and above)."""
    yield from _recorded(logging.WARNING)


@pytest.fixture
def logged():
    """What reaches train.log (INFO and above)."""
    yield from _recorded(logging.INFO)


async def _steps(watchdog: Watchdog, durations: list[float]) -> None:
    for step, seconds in enumerate(durations, start=1):
        with watchdog.watching(step), step_deadline(step, None), Timer("generate"):
            with operation("generate"):
                await trio.sleep(seconds)


async def test_a_step_past_five_medians_writes_one_line_and_runs_to_its_end(
    autojump_clock, tmp_path, dumps, logged
):
    dumper = Dumper(tmp_path)
    trio.lowlevel.add_instrument(dumper.clock)  # as the run does: how long each task waits
    watchdog = Watchdog(dumper, min_s=60, first_step_s=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog.run)
        t0 = trio.current_time()
        await _steps(watchdog, [20, 30, 25, 1000])  # median 25: the 4th step's limit is 125 s
        end = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    trio.lowlevel.remove_instrument(dumper.clock)
    (when, message), *more = dumps
    assert more == []  # once, though the step ran 875 s past it
    assert when - t0 == pytest.approx(75 + 125)
    # one line on the console: how long, and what has not moved for how long
    assert message.startswith(
        "step 4 has run 125.0s, past the watchdog's 125.0s (trainer.watchdog); operation "
        "'generate' (stage 'generate') has not run for 125.0s. Nothing is stopped; the task "
        f"tree is in train.log (live: python -m trainer debug dump {tmp_path})"
    )
    assert "\n" not in message
    # the whole tree, in train.log only
    [tree] = [m for _t, m in logged if m.startswith("step 4's task tree")]
    assert "step 4 (stage='generate', operation='generate')" in tree
    assert "trio tasks" in tree and "stage=generate" in tree
    assert end == pytest.approx(1075)  # nothing was stopped


async def test_a_slow_first_step_is_judged_by_first_step_s_not_min_s(
    autojump_clock, tmp_path, dumps
):
    # SmolLM2's first step on a loaded machine: 117 s, healthy (issue 64 saw a 28-line dump)
    watchdog = Watchdog(Dumper(tmp_path), min_s=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog.run)
        await _steps(watchdog, [117, 20])
        assert dumps == []
        fresh = Watchdog(Dumper(tmp_path), min_s=60, first_step_s=300)  # a hung first step
        await nursery.start(fresh.run)
        t0 = trio.current_time()
        await _steps(fresh, [400])
        nursery.cancel_scope.cancel()
    [(when, message)] = dumps
    assert when - t0 == pytest.approx(300) and message.startswith("step 1 has run 300.0s")


async def test_later_steps_wait_at_least_min_s_and_a_fixed_after_s_wins(
    autojump_clock, tmp_path, dumps
):
    watchdog = Watchdog(Dumper(tmp_path), min_s=60)
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog.run)
        await _steps(watchdog, [59, 2, 2, 2])  # step 1 under 60 s: quiet; then 5 x 2 < 60
        assert dumps == []
        watchdog.after_s = 3
        t0 = trio.current_time()
        await _steps(watchdog, [2, 4])
        nursery.cancel_scope.cancel()
    [(when, message)] = dumps
    assert when - t0 == pytest.approx(2 + 3) and message.startswith("step 2 has run 3.0s")


async def test_a_step_timeout_is_preceded_by_the_dump_of_where_the_step_was(
    autojump_clock, tmp_path, dumps
):
    watchdog = Watchdog(Dumper(tmp_path), step_timeout_s=100, min_s=600)
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog.run)
        with pytest.raises(StepTimeoutError):
            with watchdog.watching(7), step_deadline(7, 100):
                with Timer("train_critic_and_policy"), operation("forward_backward"):
                    await trio.sleep_forever()
        nursery.cancel_scope.cancel()
    [(when, message)] = dumps
    assert when == pytest.approx(100)  # written as the error leaves the step
    assert message.startswith("step 7 is about to fail with StepTimeoutError")
    # taken 3 s before the deadline, while the step still waited where it hung
    assert "step 7 (stage='train_critic_and_policy', operation='forward_backward')" in message
    assert "StepTimeoutError in 3.0s (budget 100s)" in message


async def test_a_disabled_watchdog_stays_quiet_but_still_says_which_step_runs(
    autojump_clock, tmp_path, dumps
):
    watchdog = Watchdog(Dumper(tmp_path), after_s=1, enabled=False)
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog.run)
        assert watchdog.running_step() is None
        with watchdog.watching(3):
            await trio.sleep(10)
            assert watchdog.running_step() == (3, pytest.approx(10))
        nursery.cancel_scope.cancel()
    assert dumps == []
