"""Repeated warnings reach the console counted, one line per step at most and fewer as they go
on, with a closing count; train.log keeps every one (issue 64: a reward that fails on 5% of
replies wrote dozens of lines per step; dynamic sampling 27 in 200 steps)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from trainer.metrics import end_step, setup_run_logging, teardown_run_logging

log = logging.getLogger("trainer.data")

REWARD = "reward %s failed (%d in this batch, data.max_reward_failures=%d): %s"
EXHAUSTED = "step %d: dynamic sampling found %d of %d informative groups in %d rounds"


def test_a_warning_of_every_call_costs_a_handful_of_lines_and_train_log_keeps_each(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    handlers = setup_run_logging(tmp_path)
    try:
        for step in range(1, 21):  # 20 steps, 6 failed reward calls each, one exhaustion
            for call in range(6):
                log.warning(REWARD, "judge", call + 1, 100, "timed out after 5s")
            log.warning(EXHAUSTED, step, 0, 16, 10)
            end_step(step)
        log.warning("engine %d failed: %s", 1, "ConnectError")  # another kind: shown at once
    finally:
        teardown_run_logging(handlers)
    console = capsys.readouterr().err.splitlines()
    rewards = [line for line in console if "reward judge failed" in line]
    exhausted = [line for line in console if "dynamic sampling found" in line]
    # the first at once; then the 1st, 2nd, 4th, 8th and 16th step the kind recurs in (steps
    # 1, 2, 4, 8, 16 for the rewards; 2, 3, 5, 9, 17 for the exhaustions); then the total
    assert len(rewards) == 1 + 5 + 1 and len(exhausted) == 1 + 5 + 1
    assert rewards[0] == "WARNING: reward judge failed (1 in this batch, " + (
        "data.max_reward_failures=100): timed out after 5s"
    )
    more = re.compile(r"\[(\d+) more like this")
    held = [int(m.group(1)) for m in map(more.search, rewards[1:]) if m]
    assert held == [5, 6, 12, 24, 48, 24]  # with the first: 120
    assert rewards[-1].endswith(
        "[24 more like this since the last such line, 120 in all by the end of the run; "
        "each in train.log]"
    )
    assert exhausted[1].startswith("WARNING: step 2: dynamic sampling")
    assert (
        "[1 more like this since the last such line, 2 in all by the end of step 2"
        in (exhausted[1])
    )
    assert "20 in all by the end of the run" in exhausted[-1]
    assert "WARNING: engine 1 failed: ConnectError" in console
    assert len(console) == 7 + 7 + 1
    written = (tmp_path / "train.log").read_text()
    assert written.count("reward judge failed") == 120
    assert written.count("dynamic sampling found") == 20
    assert "more like this" not in written  # the counts are the console's; the log has each
