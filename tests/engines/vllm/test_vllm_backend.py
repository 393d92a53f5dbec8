"""``engine.backend=vllm`` on the CPU: the trainer starts real vLLM, trains through the gloo
plugin with exact weights, and leaves no process behind."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from tests.engines.vllm.conftest import PROJECT, VLLM_PYTHON

pytestmark = pytest.mark.vllm


def marked_processes(mark: str) -> list[int]:
    """The live processes whose environment carries ``mark`` (a run's children inherit it)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if f"TRAINER_TEST_MARK={mark}".encode() in environ.split(b"\0") and state != "Z":
            found.append(int(entry.name))
    return found


def test_engine_backend_vllm_trains_3_steps_exactly_and_leaves_no_process(tmp_path):
    mark = uuid.uuid4().hex
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(PROJECT), "TRAINER_TEST_MARK": mark}
    cmd = [str(VLLM_PYTHON), "-m", "trainer", "engine.backend=vllm", "sync.transport=gloo"]
    cmd += ["model.path=builtin:tiny-vllm", "trainer.max_steps=3", f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # the engine sampled with exactly the policy's weights
        assert abs(row["policy/is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["policy/is_ratio_max"] - 1) < 1e-3, row
    assert marked_processes(mark) == []
