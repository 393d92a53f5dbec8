"""``engine.backend=vllm`` on the CPU: the trainer starts real vLLM, trains through the gloo
plugin with exact weights, and leaves no process behind."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.e2e.helpers import new_marker, trainer_env, wait_until_gone
from tests.engines.vllm.conftest import PROJECT, VLLM_PYTHON

pytestmark = pytest.mark.vllm


def test_engine_backend_vllm_trains_3_steps_exactly_and_leaves_no_process(tmp_path):
    marker = new_marker()
    run_dir = tmp_path / "run"
    env = trainer_env(marker)  # every process of the run carries the marker
    cmd = [str(VLLM_PYTHON), "-m", "trainer", "engine.backend=vllm", "sync.transport=gloo"]
    cmd += ["model.path=builtin:tiny-vllm", "trainer.max_steps=3", f"trainer.run_dir={run_dir}"]
    proc = subprocess.run(cmd, env=env, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:  # the engine sampled with exactly the policy's weights
        assert abs(row["policy/is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["policy/is_ratio_max"] - 1) < 1e-3, row
    # vLLM's worker can outlive its server by a moment: a bounded wait, not an instant
    assert wait_until_gone(marker) == []
