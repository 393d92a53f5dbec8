"""SIGKILL a training run at random moments, over and over: every resume continues it.

Each round starts ``python -m trainer ... trainer.resume_mode=latest`` on the same run
directory and kills it with SIGKILL at a moment drawn from a seeded RNG: during start-up
(imports, model, the resume itself, the first weight sync) or a random time after one of
its steps (generation, training, a checkpoint save, pruning, the weight sync). The run
uses the in-process engine, so a round costs a start-up and a few short steps (that an
engine server follows a SIGKILLed trainer is ``test_train_cli``'s). After each
kill, ``python -m trainer ckpt verify`` passes, no process of the run is left, and the
metrics hold steps 1..M without a gap; the next round resumes from exactly the checkpoint
``latest`` named and goes on from the step after it. A last round runs to the end, and its
numbers equal those of a run that was never killed (the resume is exact).

Rounds: ``TRAINER_SOAK_ROUNDS`` (default 2 in the suite: one kill mid-step, one in start-up,
then the last round; the full soak is ``TRAINER_SOAK_ROUNDS=10``, about two minutes). ``TRAINER_SOAK_SEED`` changes
the kill moments; ``pytest -s`` prints where each kill landed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.helpers import (
    REPO,
    new_marker,
    popen_trainer,
    read_metrics,
    run_trainer,
    wait_until_gone,
)
from trainer.checkpoint import CheckpointManager

pytestmark = pytest.mark.slow

ROUNDS = int(os.environ.get("TRAINER_SOAK_ROUNDS", "2"))
SEED = int(os.environ.get("TRAINER_SOAK_SEED", "12"))
#: Short steps with a checkpoint at every one (and pruning), so kills land in saves often.
RUN = (
    "engine.backend=inprocess",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "generator.sampling.max_tokens=2",
    "trainer.ckpt_interval=1",
    "trainer.max_ckpts_to_keep=2",
    "data.reward_fn=tests.trainer.helpers:varied_reward",
)
#: The killed rounds never reach it; the last round stops two steps after its resume.
NEVER = 10_000
STEP_LINE = re.compile(r"INFO trainer\.run: step (\d+) reward")
RESUMED_LINE = re.compile(r"resumed from (\S+) at step (\d+)")


def _kill_moment(round_: int, rng: random.Random) -> tuple[int, float]:
    """(steps the round completes first, seconds after that): rounds 1, 5, 9 are killed in
    start-up, the others within a second after step 1, 2 or 3 of the round (a step takes
    a fraction of a second, so any of its stages)."""
    if round_ % 4 == 1:
        return 0, rng.uniform(0.0, 8.0)
    return rng.randint(1, 3), rng.uniform(0.0, 1.0)


def _kill_after(proc: subprocess.Popen[str], log: Path, offset: int, steps: int, delay: float):
    """Wait until the round has logged ``steps`` steps (bounded), sleep ``delay``, SIGKILL."""
    deadline = time.monotonic() + 240
    while steps and time.monotonic() < deadline and proc.poll() is None:
        new = log.read_text()[offset:] if log.exists() else ""
        if len(STEP_LINE.findall(new)) >= steps:
            break
        time.sleep(0.05)
    time.sleep(delay)
    if proc.poll() is not None:
        output = proc.stdout.read() if proc.stdout else ""
        pytest.fail(f"the run ended (exit {proc.returncode}) before it was killed:\n{output}")
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def _verify_cli(run_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "ckpt", "verify", str(run_dir)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def _latest_step(run_dir: Path) -> int:
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    return 0 if latest is None else int(CheckpointManager.read_trainer_state(latest)["step"])


def _steps(run_dir: Path) -> list[int]:
    return (
        [r["step"] for r in read_metrics(run_dir)] if (run_dir / "metrics.jsonl").exists() else []
    )


def _check_resume(log_part: str, run_dir: Path, latest: int) -> None:
    """The round's log resumed from the checkpoint ``latest`` named (if it got that far)."""
    resumed = RESUMED_LINE.findall(log_part)
    if latest == 0:
        assert not resumed, "a resume with no checkpoint to resume from"
        return
    for path, step in resumed:
        assert (int(step), Path(path).name) == (latest, f"global_step_{latest}")
    steps = [int(s) for s in STEP_LINE.findall(log_part)]
    assert steps == list(range(latest + 1, latest + 1 + len(steps))), steps


def test_runs_killed_at_random_moments_resume_from_verified_checkpoints(tmp_path):
    run_dir, straight_dir = tmp_path / "soak", tmp_path / "straight"
    log = run_dir / "train.log"
    rng = random.Random(SEED)
    history: list[str] = []  # what happened, for the failure message
    latest = 0
    for round_ in range(ROUNDS):
        steps, delay = _kill_moment(round_, rng)
        history.append(f"round {round_}: kill {delay:.2f}s after step {steps} of the round")
        marker = new_marker()
        offset = len(log.read_text()) if log.exists() else 0
        proc = popen_trainer(
            *RUN,
            f"trainer.max_steps={NEVER}",
            f"trainer.run_dir={run_dir}",
            "trainer.resume_mode=latest",
            marker=marker,
        )
        try:
            _kill_after(proc, log, offset, steps, delay)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
            if proc.stdout:
                proc.stdout.close()
        assert proc.returncode == -signal.SIGKILL, history
        assert wait_until_gone(marker) == [], history
        verified = _verify_cli(run_dir)
        assert verified.returncode == 0, (history, verified.stdout, verified.stderr)
        _check_resume(log.read_text()[offset:] if log.exists() else "", run_dir, latest)
        latest = _latest_step(run_dir)
        history[-1] += f": latest checkpoint step {latest}, metrics {_steps(run_dir)[-3:]}"
        steps_so_far = _steps(run_dir)
        assert steps_so_far == list(range(1, len(steps_so_far) + 1)), history
        # the checkpoint's own step may lack its line (killed after the save, before the
        # step ended): the resume restores it from the checkpoint
        assert len(steps_so_far) >= latest - 1, history

    last = latest + 2
    offset = len(log.read_text()) if log.exists() else 0
    final = run_trainer(
        *RUN,
        f"trainer.max_steps={last}",
        f"trainer.run_dir={run_dir}",
        "trainer.resume_mode=latest",
    )
    assert final.returncode == 0, (history, final.stderr)
    _check_resume(log.read_text()[offset:], run_dir, latest)
    if latest:
        assert f"at step {latest}" in log.read_text()[offset:], history
    assert _steps(run_dir) == list(range(1, last + 1)), history
    assert _verify_cli(run_dir).returncode == 0

    print("\n".join(history))  # with -s: where each kill landed
    straight = run_trainer(*RUN, f"trainer.max_steps={last}", f"trainer.run_dir={straight_dir}")
    assert straight.returncode == 0, straight.stderr
    for key in ("data/example_index", "reward/mean", "policy/loss", "policy/grad_norm"):
        assert [r[key] for r in read_metrics(run_dir)] == [
            r[key] for r in read_metrics(straight_dir)
        ], (key, history)
