"""Weight sync end to end: a slow transfer never stalls the loop; a hung group init fails fast."""

from __future__ import annotations

import re

import pytest

from tests.e2e.helpers import (
    last_stderr_line,
    new_marker,
    read_metrics,
    run_trainer,
    wait_until_gone,
)


@pytest.mark.parametrize("transport", ["disk", "gloo"])
def test_a_slow_transfer_does_not_stall_the_event_loop(tmp_path, transport):
    marker = new_marker()
    proc = run_trainer(
        "trainer.max_steps=3",
        f"sync.transport={transport}",
        "faults=broadcast_to_inference_engines:sleep=3@2",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = {m["step"]: m for m in read_metrics(tmp_path)}
    assert sorted(steps) == [1, 2, 3]
    assert steps[2]["sync/last_weight_sync_seconds"] >= 3
    assert steps[2]["sync/last_weight_sync_seconds"] > steps[1]["sync/last_weight_sync_seconds"]
    # the loop kept serving while the transfer thread slept 3 s (frozen, it would stall 3000 ms)
    assert steps[2]["loop/max_stall_ms"] < 1500, steps[2]
    assert wait_until_gone(marker) == []


def test_a_hung_group_init_ends_with_checkpoint_engine_init_error_and_no_process_left(tmp_path):
    marker = new_marker()
    proc = run_trainer(
        "trainer.max_steps=3",
        "sync.transport=gloo",
        "sync.group_init_timeout_s=10",
        "faults=init_process_group:hang",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode != 0
    line = last_stderr_line(proc)
    assert re.fullmatch(
        r"CheckpointEngineInitError: process group 'weight_sync' did not initialise within 10s; "
        r".*sync\.group_init_timeout_s \(env TRAINER_GROUP_INIT_TIMEOUT_S\)",
        line,
    ), line
    assert wait_until_gone(marker) == []
