"""``python -m trainer debug dump`` on a run that is really hung: where it waits, the hung
thread's stack, the engine server's state; and thread stacks when the event loop is blocked."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.helpers import REPO, new_marker, popen_trainer, trainer_env, wait_until_gone

pytestmark = pytest.mark.slow


def debug_dump(*args: str, marker: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer", "debug", "dump", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=trainer_env(marker),
        cwd=REPO,
    )


def wait_for_fault(run_dir: Path, fault: str, proc: subprocess.Popen[str]) -> None:
    """Until ``fault`` has fired (the process that fired it logged it); fail if the run ends."""
    fired = run_dir / "faults_fired.log"
    deadline = time.monotonic() + 280
    while not (fired.exists() and fault in fired.read_text().splitlines()):
        assert proc.poll() is None, f"the run ended before {fault} fired"
        assert time.monotonic() < deadline, f"{fault} never fired"
        time.sleep(0.5)


def wait_for_line(path: Path, text: str, proc: subprocess.Popen[str]) -> str:
    """The first line of ``path`` holding ``text``, once it is there; fail if the run ends."""
    deadline = time.monotonic() + 120
    while True:
        found = [line for line in path.read_text().splitlines() if text in line]
        if found:
            return found[0]
        assert proc.poll() is None, f"the run ended before {path.name} said {text!r}"
        assert time.monotonic() < deadline, f"{path.name} never said {text!r}"
        time.sleep(0.5)


def tasks(node: dict[str, Any]) -> list[dict[str, Any]]:
    return [node, *(t for child in node["children"] for t in tasks(child))]


def stop(proc: subprocess.Popen[str], marker: str) -> None:
    proc.send_signal(signal.SIGINT)
    try:
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert wait_until_gone(marker) == []


def test_a_dump_of_a_run_hung_in_forward_backward_shows_the_stage_operation_and_hung_thread(
    tmp_path,
):
    marker = new_marker()
    proc = popen_trainer(
        "trainer.max_steps=3",
        "faults=forward_backward:hang@2",
        # step 2 never ends: its dump comes 5 s in, however slow the machine (a slow step 1
        # gets a dump of its own, which the test tells apart by its step number)
        "trainer.watchdog.after_s=5",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    try:
        wait_for_fault(tmp_path, "forward_backward:hang@2", proc)
        text = debug_dump(str(tmp_path), marker=marker)
        as_json = debug_dump(str(proc.pid), "--json", marker=marker)
        watchdog = wait_for_line(tmp_path / "train.log", "step 2 has run", proc)
    finally:
        stop(proc, marker)
    # the watchdog said in one line what waits, and since when; wrote the same tree as the
    # dump into train.log on its own, and left the step running
    assert "operation 'forward_backward' (stage 'train_critic_and_policy') has not run" in (
        watchdog
    )
    log = (tmp_path / "train.log").read_text()
    tree = log.split("step 2's task tree", 1)[1]
    assert "step 2 (stage='train_critic_and_policy', operation='forward_backward')" in tree
    assert "in fire_fault_sync: _release.wait()" in tree
    assert text.returncode == 0, text.stderr
    out = text.stdout
    assert "step 2 (stage='train_critic_and_policy', operation='forward_backward')" in out
    assert "stage=train_critic_and_policy" in out and "operation=forward_backward" in out
    assert "worker:forward_backward" in out
    assert "in fire_fault_sync: _release.wait()" in out  # the hung thread, where it hangs
    assert "engine servers" in out and "is_paused=False" in out

    assert as_json.returncode == 0, as_json.stderr
    snapshot = json.loads(as_json.stdout)
    assert snapshot["pid"] == proc.pid
    (loop,) = [t for t in tasks(snapshot["tasks"]) if t["operation"] == "forward_backward"]
    assert (loop["step"], loop["stage"]) == (2, "train_critic_and_policy")
    assert loop["budget_s"] is None  # no step timeout: nothing would ever end this step
    (hung,) = [t for t in snapshot["threads"] if t["name"] == "worker:forward_backward"]
    assert any("_fire_then" in line for line in hung["stack"])
    (engine,) = snapshot["engines"]
    assert engine["num_requests_running"] == 0 and engine["is_paused"] is False


def test_a_dump_of_a_run_hung_in_an_engine_servers_pause_shows_the_call_and_the_server(tmp_path):
    marker = new_marker()
    proc = popen_trainer(
        "trainer.max_steps=3",
        "faults=/pause:hang@2",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
    )
    try:
        wait_for_fault(tmp_path, "/pause:hang@2", proc)
        as_json = debug_dump(str(tmp_path), "--json", marker=marker)
    finally:
        stop(proc, marker)
    assert as_json.returncode == 0, as_json.stderr
    snapshot = json.loads(as_json.stdout)
    waiting = [t for t in tasks(snapshot["tasks"]) if t["operation"] == "/pause"]
    assert waiting and all((t["step"], t["stage"]) == (2, "sync_weights") for t in waiting)
    (engine,) = snapshot["engines"]
    # the server took the call and never answered it: not paused, /pause its last call
    assert engine["is_paused"] is False and "error" not in engine
    assert engine["last_control_calls"][-1] == "/pause?mode=keep"


BLOCKED_LOOP = """
import sys, time
from pathlib import Path
import trio
from trainer.debug import Dumper, open_debug_services

async def main():
    async with open_debug_services(Dumper(Path(sys.argv[1]))):
        print("ready", flush=True)
        time.sleep(600)  # the bug under test: a blocking call on the trio thread

trio.run(main)
"""


def test_a_blocked_event_loop_still_gives_the_stacks_of_all_its_threads(tmp_path):
    marker = new_marker()
    proc = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_LOOP, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env=trainer_env(marker),
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        out = debug_dump(str(tmp_path), "--timeout", "3", marker=marker)
    finally:
        proc.kill()
        proc.communicate()
    assert out.returncode == 0, out.stderr
    assert f"trainer pid {proc.pid} did not answer its debug socket" in out.stdout
    assert 'File "<string>", line 10 in main' in out.stdout  # the blocking call
