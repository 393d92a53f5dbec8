"""Ctrl-C on a real run: one line saying where it was, exit status 130, nothing left running,
and the last complete checkpoint still verifies."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import pytest

from tests.e2e.helpers import REPO, new_marker, popen_trainer, read_metrics, wait_until_gone

pytestmark = pytest.mark.slow

INTERRUPTED = re.compile(
    r"KeyboardInterrupt: interrupted at step (?P<step>\d+) "
    r"\(stage=(?P<stage>'\w+'|None), operation='[\w/]+'\); stopped in (?P<s>[\d.]+)s"
)


def test_ctrl_c_mid_run_stops_cleanly_says_where_and_leaves_a_verified_checkpoint(tmp_path):
    marker = new_marker()
    proc = popen_trainer(
        "trainer.max_steps=100",
        "trainer.ckpt_interval=1",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    try:
        deadline = time.monotonic() + 280
        while not ((tmp_path / "metrics.jsonl").exists() and len(read_metrics(tmp_path)) >= 2):
            assert proc.poll() is None, "the run ended before its second step"
            assert time.monotonic() < deadline, "no second step in time"
            time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=120)
        stopped_after = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, out[-3000:]
    last = out.strip().splitlines()[-1]
    match = INTERRUPTED.fullmatch(last)
    assert match, last
    assert int(match["step"]) >= 2
    assert f"Ctrl-C at step {match['step']}" in out  # said at once, before stopping
    assert stopped_after < 60  # within trainer.interrupt_grace_s, not killed
    assert wait_until_gone(marker) == []
    verify = subprocess.run(
        [sys.executable, "-m", "trainer", "ckpt", "verify", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not (tmp_path / "debug.json").exists()
