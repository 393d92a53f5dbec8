"""``python -m trainer`` on Ray end to end: Ray workers, Ray-placed engines, own or shared cluster."""

from __future__ import annotations

import ast
import re
import signal
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    alive_after,
    last_stderr_line,
    new_marker,
    popen_trainer,
    processes_with_marker,
    read_metrics,
    run_trainer,
    wait_until_gone,
)

pytestmark = pytest.mark.slow

STEPS = ("trainer.max_steps=3", "trainer.seed=3")


def actor_pids(run_dir: Path) -> list[int]:
    match = re.search(r"ray workers up: (\{.*\})", (run_dir / "train.log").read_text())
    assert match, "train.log names the actors' processes"
    return list(ast.literal_eval(match.group(1)).values())


def test_two_ray_workers_complete_and_follow_the_local_reward_curve(ray_cluster, tmp_path):
    """Everything on Ray (data-parallel workers, engines, weights broadcast from rank 0's
    actor) against the same run on the local backends (disk transport)."""
    ray_dir, local_dir = tmp_path / "ray", tmp_path / "local"
    marker = new_marker()
    proc = run_trainer(
        *STEPS,
        "workers.backend=ray",
        "workers.num_policy_workers=2",
        "engine.placement=ray",
        "sync.transport=gloo",
        f"workers.ray_address={ray_cluster}",
        "workers.device=cpu",  # a cluster the run joins: said, not guessed from the driver
        f"trainer.run_dir={ray_dir}",
        marker=marker,
    )
    assert proc.returncode == 0, proc.stderr
    pids = actor_pids(ray_dir)
    assert len(pids) == 2
    assert "ray engines up: {'http://" in (ray_dir / "train.log").read_text()
    assert alive_after(pids) == [], "the run's actors are gone after it exits"
    assert wait_until_gone(marker) == [], "engine actors and their servers are gone too"

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


def test_failed_run_with_ray_placed_engines_leaves_no_process_of_its_own_cluster(tmp_path):
    """No ``workers.ray_address``: the run starts its own cluster; a step error stops it all.

    The ``/pause`` hang fires inside the Ray-placed server (the fault spec reaches it through
    the actor's environment); the control-plane timeout names it.
    """
    marker = new_marker()
    proc = run_trainer(
        "trainer.max_steps=3",
        "engine.placement=ray",
        "engine.control_plane_timeout_s=5",
        "faults=/pause:hang@2",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    assert proc.returncode != 0
    line = last_stderr_line(proc)
    assert re.fullmatch(
        r"InferenceServerTimeoutError: /pause on http://[\d.]+:\d+ did not answer within 5s "
        r"\(engine\.control_plane_timeout_s, env TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S\)",
        line,
    ), line
    log = (tmp_path / "train.log").read_text()
    assert "ray engines up" in log
    assert "stopped the local Ray cluster this run started" in log
    # servers, engine actors, and the cluster's own processes (GCS, raylet) all carry the marker
    assert wait_until_gone(marker, timeout=60) == []


def test_sigkilled_trainer_takes_its_cluster_actors_and_servers_down(tmp_path):
    """No cleanup code runs on SIGKILL: Ray's fate sharing takes the cluster the trainer
    started (and its actors) down, and each server exits when its actor's stdin pipe closes.
    Measured: the actors and the server were gone 1.5 s after the kill."""
    marker = new_marker()
    proc = popen_trainer(
        "trainer.max_steps=5",
        "workers.backend=ray",
        "engine.placement=ray",
        "faults=generate:delay=600@2",  # parked in step 2's generation (non-blocking)
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    try:
        deadline = time.monotonic() + 240
        metrics = tmp_path / "metrics.jsonl"
        while not (metrics.exists() and metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the run never finished step 1"
            time.sleep(0.2)
        running = processes_with_marker(marker)
        # the trainer, GCS, raylet, the engine's actor and server, the policy actor at least
        assert len(running) >= 6, running
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout:
            proc.stdout.close()
    # Ray's own dashboard and runtime-env agents outlive their raylet by ~60 s (they try to
    # report its death to the dead GCS until Ray's reconnect timeout): not ours to kill
    assert wait_until_gone(marker, ignore=_ray_agent) == []


def _ray_agent(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return cmdline.startswith((b"ray::DashboardAgent", b"ray::RuntimeEnvAgent"))
