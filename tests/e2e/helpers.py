"""Running ``python -m trainer`` for real, and checking that nothing of it survives."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def trainer_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_FAULTS"}
    env["TRAINER_TEST_MARKER"] = marker  # inherited by every process the run starts
    env["PYTHONPATH"] = str(REPO)
    return env


def new_marker() -> str:
    return uuid.uuid4().hex


def run_trainer(
    *args: str, marker: str | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "trainer.progress=false", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=trainer_env(marker or new_marker()),
        cwd=REPO,
    )


def popen_trainer(*args: str, marker: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "trainer.progress=false", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=trainer_env(marker),
        cwd=REPO,
    )


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (the run and its children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if f"TRAINER_TEST_MARKER={marker}".encode() in environ and state != "Z":
            found.append(int(proc.name))
    return found


def wait_until_gone(
    marker: str, timeout: float = 30.0, *, ignore: Callable[[int], bool] = lambda pid: False
) -> list[int]:
    """Processes with ``marker`` still alive after ``timeout`` seconds (servers of a SIGKILLed
    trainer exit when their stdin pipe closes; give them a bounded moment). Processes for
    which ``ignore(pid)`` holds are not waited for."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in processes_with_marker(marker) if not ignore(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def alive_after(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Of ``pids``, those still alive after waiting up to ``timeout`` seconds for them to exit."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_stderr_line(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stderr.strip().splitlines()[-1]


def run_in_own_ray_cluster(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run ``script`` (Python that starts a Ray cluster of its own and prints one line
    ``RESULT <json>``) in a child process; the decoded JSON. Fails with the child's stderr
    when it exits non-zero or prints no result."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": ""},  # a cluster of its own, not the suite's
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))
