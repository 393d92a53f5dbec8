"""``python -m trainer`` end to end: metrics, checkpoints, and resume after SIGKILL."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    new_marker,
    popen_trainer,
    read_metrics,
    run_trainer,
    wait_until_gone,
)
from trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

SMALL = ("trainer.train_batch_size=4", "generator.n_samples_per_prompt=4")


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """The default run for 4 steps, a checkpoint every 2, told to resume from the latest
    checkpoint of a directory that has none: its directory and outcome, shared by the test of
    what a run writes, the test of ``resume_mode=latest`` without checkpoints, and the test of
    the ``ckpt`` subcommands (which works on a copy: it breaks and prunes checkpoints)."""
    run_dir = tmp_path_factory.mktemp("four-steps") / "run"
    proc = run_trainer(
        "trainer.max_steps=4",
        "trainer.ckpt_interval=2",
        "trainer.resume_mode=latest",
        f"trainer.run_dir={run_dir}",
        "trainer.progress=true",  # the console's start-up lines (plain: stderr is a file)
    )
    return run_dir, proc


def test_four_steps_write_metrics_checkpoints_and_latest(four_steps):
    run_dir, proc = four_steps
    assert proc.returncode == 0, proc.stderr
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:
        assert {
            "reward/mean",
            "policy/loss",
            "policy/grad_norm",
            "response_length/mean",
        } <= r.keys()
        stages = [
            "generate",
            "fwd_logprobs_values_reward",
            "compute_advantages",
            "train_critic_and_policy",
            "save_checkpoints",
            "sync_weights",
        ]
        timed = [r[f"timing/{stage}"] for stage in stages if f"timing/{stage}" in r]
        assert len(timed) >= 5 and all(t > 0 for t in timed)
        # the stages run one after the other inside the step
        assert sum(timed) <= r["timing/step"]
    assert "timing/save_checkpoints" in rows[1] and "timing/save_checkpoints" not in rows[2]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir() if not p.name.startswith(".")) == [
        "global_step_2",
        "global_step_4",
        "latest",
    ]
    assert (ckpts / "latest").read_text().strip() == "global_step_4"
    assert CheckpointManager.verify(ckpts / "global_step_4") == []
    assert (run_dir / "config.yaml").is_file() and (run_dir / "train.log").is_file()
    assert "mean reward: first 20% of steps" in proc.stderr


def test_the_console_and_the_engine_log_name_the_engine_process_id_and_no_empty_folder_is_left(
    four_steps,
):
    """What the fault-tolerance journey needs (``kill -9 -- -PID`` of an engine), said where
    the engine starts: the console line after its start, and its log's first line."""
    run_dir, proc = four_steps
    log = run_dir / "engines" / "engine-0.log"
    (line,) = [x for x in proc.stderr.splitlines() if x.startswith("engine-0: pid ")]
    pid = int(line.removeprefix("engine-0: pid ").split(",")[0])
    assert line.endswith(f", log {log}") and ", http://127.0.0.1:" in line
    lines = proc.stderr.splitlines()
    assert lines.index("startup: engines ...") < lines.index(line)
    assert lines.index(line) < next(
        i for i, x in enumerate(lines) if x.startswith("startup: engines ready")
    )
    assert log.read_text().splitlines()[0] == f"engines.local serve: pid {pid}, process group {pid}"
    assert line in (run_dir / "train.log").read_text()
    # the disk transport's folder is gone with its last sync's files
    assert not (run_dir / "weight_sync").exists()


def test_sigkill_after_checkpoint_then_resume_continues_with_the_same_data_order(tmp_path):
    killed_dir, straight_dir = tmp_path / "killed", tmp_path / "straight"
    # a reward that varies between responses, so that every step has a loss to compare
    common = (
        *SMALL,
        "trainer.max_steps=6",
        "trainer.ckpt_interval=2",
        "data.reward_fn=tests.trainer.helpers:varied_reward",
    )
    marker = new_marker()
    # the engine dies in step 2 and is restarted (before the checkpoint: what the summary
    # counts must survive the resume); step 4's generation waits (non-blocking) long enough
    # for us to kill the run there, after step 3 was logged and global_step_2 saved
    restart = "generate:kill_engine=0@2"
    proc = popen_trainer(
        *common,
        f"trainer.run_dir={killed_dir}",
        f"faults={restart},generate:delay=600@4",
        marker=marker,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            metrics = killed_dir / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.2)
        else:
            pytest.fail("the first run never reached step 3")
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        if proc.stdout:
            proc.stdout.close()
    assert wait_until_gone(marker) == []  # its engine server followed it
    assert (killed_dir / "checkpoints" / "latest").read_text().strip() == "global_step_2"
    assert [r["step"] for r in read_metrics(killed_dir)] == [1, 2, 3]

    resumed = run_trainer(*common, f"trainer.run_dir={killed_dir}", "trainer.resume_mode=latest")
    assert resumed.returncode == 0, resumed.stderr
    straight = run_trainer(*common, f"trainer.run_dir={straight_dir}", f"faults={restart}")
    assert straight.returncode == 0, straight.stderr

    resumed_rows, straight_rows = read_metrics(killed_dir), read_metrics(straight_dir)
    assert [r["step"] for r in resumed_rows] == [1, 2, 3, 4, 5, 6]  # step 3 ran again, once
    assert [r["data/example_index"] for r in resumed_rows] == [
        r["data/example_index"] for r in straight_rows
    ]
    # through the HTTP engine server too, the resumed steps compute what the straight run does
    for key in ("reward/mean", "policy/loss", "policy/grad_norm", "policy/lr"):
        assert [r[key] for r in resumed_rows] == [r[key] for r in straight_rows], key
    assert len({r["policy/loss"] for r in straight_rows}) > 1
    assert "resumed from" in (killed_dir / "train.log").read_text()
    # what the run counted is the uninterrupted run's: the restart before the checkpoint too
    resumed_summary, straight_summary = (
        json.loads((d / "summary.json").read_text()) for d in (killed_dir, straight_dir)
    )
    assert resumed_rows[-1]["engine/restarts"] == straight_rows[-1]["engine/restarts"] == 1
    assert resumed_summary["engine_restarts"] == straight_summary["engine_restarts"] == 1
    (event,) = resumed_summary["engine_restart_events"]
    assert event["step"] == 2 and event["engine"] == 0
    assert resumed_summary["totals"] == straight_summary["totals"]
    assert "counted over the run: 1 engine restart" in resumed.stderr


def test_resume_latest_without_checkpoints_starts_fresh(four_steps):
    run_dir, proc = four_steps
    assert proc.returncode == 0, proc.stderr
    assert [r["step"] for r in read_metrics(run_dir)] == [1, 2, 3, 4]
    assert "no checkpoint under" in (run_dir / "train.log").read_text()
    assert "starting from step 1" in (run_dir / "train.log").read_text()


def test_ckpt_subcommands_list_verify_and_prune(four_steps, tmp_path):
    shared, proc = four_steps
    assert proc.returncode == 0, proc.stderr
    run_dir = tmp_path / "run"
    shutil.copytree(shared, run_dir, symlinks=True)

    def ckpt(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "trainer", "ckpt", *args], capture_output=True, text=True
        )

    listed = ckpt("list", str(run_dir))
    assert listed.returncode == 0
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == [
        "global_step_2",
        "global_step_4",
    ]
    assert listed.stdout.splitlines()[-1].endswith("(latest)")
    shown = ckpt("show", str(run_dir))  # the latest checkpoint: its state, then its files
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert lines[0].endswith("global_step_4")
    state = json.loads(shown.stdout[shown.stdout.index("{") : shown.stdout.index("\n}") + 2])
    assert state["step"] == 4 and state["loader"]
    files = [
        line.split("\t")[0].strip() for line in lines if line.startswith("  ") and "\t" in line
    ]
    assert {"trainer_state.json", "manifest.json", "optimizer.pt"} <= set(files)
    one = ckpt("show", str(run_dir / "checkpoints" / "global_step_2"))
    assert one.returncode == 0 and one.stdout.splitlines()[0].endswith("global_step_2")
    assert ckpt("verify", str(run_dir)).returncode == 0
    optimizer = run_dir / "checkpoints" / "global_step_2" / "optimizer.pt"
    data = bytearray(optimizer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte
    optimizer.write_bytes(bytes(data))
    broken = ckpt("verify", str(run_dir))
    assert broken.returncode == 1
    assert "global_step_2: BROKEN" in broken.stdout and "global_step_4: OK" in broken.stdout
    pruned = ckpt("prune", str(run_dir), "--keep", "1")
    assert pruned.returncode == 0
    assert not (run_dir / "checkpoints" / "global_step_2").exists()
    assert (run_dir / "checkpoints" / "global_step_4").is_dir()
