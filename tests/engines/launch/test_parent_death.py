"""Children die with what started them, however it dies, from their first instruction:
``engines.launch.open_child`` (``PR_SET_PDEATHSIG`` under ``engines.launch.parent_death``),
``stdin_guard`` taking its group along, and a reference server that watches its stdin from the
start of ``main`` (real processes; each waits for what it observes, bounds generous)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import trio

from engines.launch import _children, open_child, parent_death
from tests.e2e.helpers import (
    MARKER_ENV,
    REPO,
    alive_after,
    new_marker,
    pid_alive,
    processes_with_marker,
    wait_until_gone,
)

#: A child that would outlive anything polite: it ignores SIGTERM and never reads its stdin.
STUBBORN = (
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "print('up', flush=True); time.sleep(600)"
)
#: A trio program that starts ``argv`` with open_child, prints its pid, and waits forever.
STARTER = """
import subprocess, sys, trio
from engines.launch import open_child

async def main():
    child = await open_child(sys.argv[1:], stdin=subprocess.PIPE, start_new_session=True)
    print(child.pid, flush=True)
    await trio.sleep_forever()

trio.run(main)
"""
SERVE = (sys.executable, "-m", "engines.local", "serve")
#: The bound the issue sets: nothing of a dead trainer after 10 s.
GONE_S = 10.0


def _start(argv: list[str], marker: str) -> tuple[subprocess.Popen[str], int]:
    env = {**os.environ, MARKER_ENV: marker, "PYTHONPATH": str(REPO)}
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, *argv], stdout=subprocess.PIPE, text=True, env=env
    )
    assert starter.stdout is not None
    return starter, int(starter.stdout.readline())


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_dies_with_its_starter_however_the_starter_dies(sig: signal.Signals) -> None:
    marker = new_marker()
    starter, child = _start([sys.executable, "-c", STUBBORN], marker)
    try:
        assert pid_alive(child)
        starter.send_signal(sig)
        assert starter.wait(30) == -sig
        assert alive_after([child], GONE_S) == []
    finally:
        starter.kill()
        starter.wait()
        assert starter.stdout is not None
        starter.stdout.close()


async def test_a_child_outlives_the_trio_thread_that_asked_for_it() -> None:
    """Linux signals the death of the forking *thread*: trio's idle threads end after 10 s,
    so a child forked from one would die with it. open_child's are forked elsewhere."""
    child = await open_child([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        seen = b""
        while not seen.endswith(b"\n"):
            seen += await child.stdout.receive_some(10)
        assert seen == b"up\n"

        def trio_threads() -> list[str]:
            return [t.name for t in threading.enumerate() if t.name.startswith("Trio thread")]

        with trio.fail_after(120):  # trio ends an idle thread after 10 s
            while trio_threads():  # noqa: ASYNC110 (other threads' state: no event to wait on)
                await trio.sleep(0.5)
        assert child.poll() is None  # still running: no thread it depends on ended
    finally:
        child.send_signal(signal.SIGKILL)
        assert await child.wait() == -signal.SIGKILL
        if child.stdout is not None:
            await child.stdout.aclose()


async def test_a_cancelled_caller_forks_nothing_and_a_cancel_mid_fork_hands_the_child_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A start asked for in a cancelled scope forks no child; one cancelled while its fork
    waits in the spawner thread still returns the child, for its owner to stop (before, trio's
    thread call raised Cancelled and the child ran on, untracked: seen as a reward pool's
    replacement worker started as the pool closed)."""
    marker = new_marker()
    monkeypatch.setenv(MARKER_ENV, marker)
    spawner = _children._spawner_thread()  # noqa: SLF001 (the one thread that forks)
    with trio.CancelScope() as scope:
        scope.cancel()
        await open_child([sys.executable, "-c", STUBBORN])
    await trio.to_thread.run_sync(spawner.submit(lambda: None).result)  # its queue is empty
    assert processes_with_marker(marker) == []
    blocker = spawner.submit(time.sleep, 2)  # the next fork waits behind this
    started = []
    with trio.move_on_after(0.1):
        started.append(await open_child([sys.executable, "-c", STUBBORN]))
        await trio.lowlevel.checkpoint()  # the cancel lands here, once the child is ours
    assert blocker.done() and len(started) == 1
    child = started[0]
    assert processes_with_marker(marker) == [child.pid]
    child.send_signal(signal.SIGKILL)
    assert await child.wait() == -signal.SIGKILL
    assert wait_until_gone(marker) == []


def test_an_orphan_never_starts_its_command(tmp_path: Path) -> None:
    """Its parent died before it could ask (here: it names another parent): it exits at once."""
    made = tmp_path / "made"
    argv = parent_death.command(["touch", str(made)], parent=1)
    assert subprocess.run(argv, check=False).returncode == parent_death.EXIT_ORPHANED
    assert not made.exists()
    assert subprocess.run(parent_death.command(["touch", str(made)]), check=False).returncode == 0
    assert made.exists()  # with its real parent named, it runs


def test_stdin_guard_takes_its_whole_group_down_when_its_launcher_is_killed() -> None:
    marker = new_marker()
    guard = [sys.executable, "-m", "engines.launch.stdin_guard", "--grace-s", "1", "--"]
    starter, guard_pid = _start([*guard, sys.executable, "-c", STUBBORN], marker)
    try:
        # the guard and the command it started (which ignores SIGTERM) carry the marker
        deadline = time.monotonic() + 60
        while len(set(processes_with_marker(marker)) - {starter.pid}) < 2:
            assert time.monotonic() < deadline, "the guard's command did not start"
            time.sleep(0.1)
        starter.kill()
        starter.wait(30)
        assert wait_until_gone(marker, GONE_S + 5) == []
        assert not pid_alive(guard_pid)
    finally:
        starter.kill()
        starter.wait()
        assert starter.stdout is not None
        starter.stdout.close()


def test_a_reference_server_whose_stdin_ends_while_it_loads_exits(
    model_dir: Path, tmp_path: Path
) -> None:
    """Its weights are a FIFO nobody writes: the load never ends. Stdin at end-of-file from
    the start; the server must not wait to be serving before it notices."""
    model = tmp_path / "model"
    shutil.copytree(model_dir, model)
    (model / "model.safetensors").unlink()
    os.mkfifo(model / "model.safetensors")
    log = tmp_path / "server.log"
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [*SERVE, "--model", str(model), "--port", "0", "--exit-on-stdin-eof"],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
    try:
        server.wait(120)  # imports, then at most STDIN_EOF_KILL_S for a load that hangs
    finally:
        server.kill()
        server.wait()
    text = log.read_text()
    assert "stdin closed" in text
    assert "ENGINE_READY" not in text


def test_stdin_guard_names_its_process_id_and_group_and_the_command_first() -> None:
    """Its first line (a guarded ``vllm serve``'s log's first line) says which process to
    signal: the guard, its group's leader."""
    guard = [sys.executable, "-m", "engines.launch.stdin_guard", "--grace-s", "1", "--"]
    proc = subprocess.Popen(
        [*guard, "echo", "served"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        text=True,
    )
    try:
        assert proc.wait(timeout=60) == 0  # the command ended (stdin stays open: no end-of-file)
    finally:
        proc.kill()
    assert proc.stdout is not None and proc.stdin is not None
    out = proc.stdout.read()
    proc.stdout.close()
    proc.stdin.close()
    assert out.splitlines() == [
        f"stdin_guard: pid {proc.pid}, process group {proc.pid}: echo served",
        "served",
    ]
