"""``python -m trainer workers.backend=ray`` end to end, against this test run's cluster."""

from __future__ import annotations

import ast
import re
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import read_metrics, run_trainer

pytestmark = pytest.mark.slow

STEPS = ("trainer.max_steps=3", "trainer.seed=3")


def actor_pids(run_dir: Path) -> list[int]:
    match = re.search(r"ray workers up: (\{.*\})", (run_dir / "train.log").read_text())
    assert match, "train.log names the actors' processes"
    return list(ast.literal_eval(match.group(1)).values())


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def test_two_ray_workers_complete_and_follow_the_local_reward_curve(ray_cluster, tmp_path):
    ray_dir, local_dir = tmp_path / "ray", tmp_path / "local"
    proc = run_trainer(
        *STEPS,
        "workers.backend=ray",
        "workers.num_policy_workers=2",
        f"workers.ray_address={ray_cluster}",
        f"trainer.run_dir={ray_dir}",
    )
    assert proc.returncode == 0, proc.stderr
    pids = actor_pids(ray_dir)
    assert len(pids) == 2
    deadline = time.monotonic() + 30
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in pids), "the run's actors are gone after it exits"

    proc = run_trainer(*STEPS, f"trainer.run_dir={local_dir}")
    assert proc.returncode == 0, proc.stderr
    ray_rows, local_rows = read_metrics(ray_dir), read_metrics(local_dir)
    assert [r["step"] for r in ray_rows] == [1, 2, 3]
    # same seed, same data, same initial weights: step 1 is the same rollout; after it the
    # two-rank gradient equals the single worker's up to float summation order
    assert ray_rows[0]["reward/mean"] == local_rows[0]["reward/mean"]
    for r, loc in zip(ray_rows, local_rows):
        assert abs(r["reward/mean"] - loc["reward/mean"]) <= 0.1, (r, loc)
        assert r["policy/grad_norm"] == pytest.approx(loc["policy/grad_norm"], rel=0.05, abs=1e-3)
