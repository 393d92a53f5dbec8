"""A checkpoint save runs off the event loop: however long it takes, the loop keeps serving."""

from __future__ import annotations

import json

import trainer.run
from trainer.config import load_config


async def test_a_slow_save_does_not_stall_the_event_loop(tmp_path):
    # the save's worker thread blocks 2 s (a slow disk looks like this); were the save on the
    # trio thread, the loop's longest stall during it would be at least as long
    await trainer.run.train(
        load_config(
            None,
            [
                "engine.backend=inprocess",
                "trainer.train_batch_size=2",
                "generator.n_samples_per_prompt=2",
                "trainer.max_steps=1",
                "trainer.ckpt_interval=1",
                "trainer.progress=false",
                f"trainer.run_dir={tmp_path}",
                "faults=save_checkpoint:sleep=2",
            ],
        )
    )
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["timing/save_checkpoints"] >= 2.0
    assert row["checkpoint/max_stall_ms"] < 1000  # generous: it is ~1 ms on an idle machine
    assert row["checkpoint/max_stall_ms"] <= row["loop/max_stall_ms"]
