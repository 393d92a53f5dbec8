"""A dump sees every task where it waits (step, stage, operation, budget), every busy thread's
stack, and reaches whoever asks over the run's debug socket."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from trainer.debug import (
    DEBUG_FILE,
    Dumper,
    WaitClock,
    open_debug_services,
    render,
    request_dump,
    stack_signal,
    task_tree,
    thread_stacks,
    where_line,
)
from trainer.debug._server import remove_stale_debug_files
from trainer.vocabulary import Timer, operation, step_deadline


def _find(node: dict[str, Any], name: str) -> dict[str, Any]:
    if node["name"] == name:
        return node
    for child in node["children"]:
        try:
            return _find(child, name)
        except LookupError:
            pass
    raise LookupError(name)


async def _stuck_in_forward_backward() -> None:
    with step_deadline(4, 30.0), Timer("train_critic_and_policy"):
        with operation("forward_backward"):
            await trio.sleep_forever()


async def test_a_task_tree_names_each_tasks_step_stage_operation_budget_and_wait(autojump_clock):
    clock = WaitClock()
    trio.lowlevel.add_instrument(clock)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_stuck_in_forward_backward, name="stuck")
            await trio.sleep(10)
            tree = task_tree(clock)
            nursery.cancel_scope.cancel()
    finally:
        trio.lowlevel.remove_instrument(clock)
    node = _find(tree, "stuck")
    assert (node["step"], node["stage"], node["operation"]) == (
        4,
        "train_critic_and_policy",
        "forward_backward",
    )
    assert node["budget_s"] == 30.0 and node["deadline_error"] == "StepTimeoutError"
    assert node["remaining_s"] == pytest.approx(20.0)
    assert node["waiting_s"] == pytest.approx(10.0)
    assert node["at"].startswith("tests/trainer/debug/test_debug_dump.py:")
    assert node["children"] == []
    snapshot = {"tasks": tree}
    assert where_line(snapshot) == (
        "step 4 (stage='train_critic_and_policy', operation='forward_backward')"
    )


def test_where_line_before_any_step_says_startup():
    root = {"name": "<init>", "step": None, "stage": None, "operation": None, "children": []}
    assert where_line({"tasks": root}) == "startup (no step running)"


async def test_a_busy_thread_shows_its_stack_and_idle_trio_threads_are_only_counted():
    release = threading.Event()
    started = threading.Event()

    def blocked() -> None:
        started.set()
        release.wait()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: trio.to_thread.run_sync(blocked, thread_name="worker:forward_backward")
        )
        await trio.to_thread.run_sync(started.wait)
        threads, _idle = thread_stacks()
        release.set()
    (mine,) = [t for t in threads if t["name"] == "worker:forward_backward"]
    assert any("in blocked: release.wait()" in line for line in mine["stack"])
    assert mine["stack"][-1].startswith("threading.py:")  # innermost last
    # back in the pool: counted, not listed
    await trio.lowlevel.checkpoint()
    threads, idle = thread_stacks()
    assert all(t["name"] != "worker:forward_backward" for t in threads)
    assert idle >= 1


async def test_the_debug_socket_serves_a_dump_and_the_run_dir_says_where_it_is(tmp_path):
    dumper = Dumper(tmp_path)
    async with open_debug_services(dumper) as nursery:
        nursery.start_soon(_stuck_in_forward_backward, name="stuck")
        info = json.loads((tmp_path / DEBUG_FILE).read_text())
        assert info["pid"] == os.getpid()
        snapshot = await trio.to_thread.run_sync(request_dump, Path(info["socket"]), 60.0)
        nursery.cancel_scope.cancel()
    assert snapshot["pid"] == os.getpid() and snapshot["run_dir"] == str(tmp_path)
    assert _find(snapshot["tasks"], "stuck")["operation"] == "forward_backward"
    assert snapshot["engines"] == []
    text = render(snapshot)
    assert "stage=train_critic_and_policy" in text and "operation=forward_backward" in text
    # the run is over: nothing left that a client could mistake for a live run
    assert not (tmp_path / DEBUG_FILE).exists()
    assert not await trio.Path(info["socket"]).exists()


def test_render_shows_many_alike_siblings_once_with_their_count():
    leaf = {
        "name": "rollout",
        "step": 1,
        "stage": "generate",
        "operation": "generate",
        "budget_s": None,
        "remaining_s": None,
        "deadline_error": None,
        "waiting_s": 1.0,
        "at": "engines/client.py:1 in generate",
        "stack": [],
        "children": [],
    }
    root = leaf | {"name": "loop", "operation": None, "children": [leaf] * 64}
    snapshot = {
        "pid": 1,
        "run_dir": "runs/x",
        "taken_at": "now",
        "step": {"step": 1, "running_s": 2.0},
        "tasks": root,
        "threads": [],
        "idle_threads": 0,
        "engines": [{"url": "http://h:1", "error": "no answer within 2s"}],
    }
    text = render(snapshot)
    assert "rollout x64" in text and text.count("rollout") == 1
    assert "step 1 running for 2.0s" in text
    assert "http://h:1  no answer within 2s" in text


def test_sigusr1_writes_every_threads_stack_without_the_event_loop(tmp_path):
    stacks = tmp_path / "stacks"
    with stack_signal(stacks):
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while "test_sigusr1" not in stacks.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        text = stacks.read_text()
    assert "Current thread" in text or "Thread 0x" in text
    assert "test_sigusr1_writes_every_threads_stack" in text
    assert not stacks.exists()  # a normal end leaves nothing behind in $TMPDIR
    # a failed one keeps the stacks asked for beside its error
    with pytest.raises(RuntimeError), stack_signal(stacks):
        os.kill(os.getpid(), signal.SIGUSR1)
        while "test_sigusr1" not in stacks.read_text() and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        raise RuntimeError("the run failed")
    assert "test_sigusr1_writes_every_threads_stack" in stacks.read_text()
    # a failed one that nobody asked stacks of leaves nothing
    with pytest.raises(RuntimeError), stack_signal(tmp_path / "unasked"):
        raise RuntimeError("the run failed")
    assert not (tmp_path / "unasked").exists()
    # a dump that comes after the end (its check raced it) is ignored, not this process's end
    # (SIGUSR1's default action): if it were not, this test's process would die here
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGUSR1)
    # a handler of the program's own is left as it was
    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    try:
        with stack_signal(tmp_path / "own"):
            pass
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while not seen and time.monotonic() < deadline:
            time.sleep(0.01)
        assert seen == [signal.SIGUSR1]
    finally:
        signal.signal(signal.SIGUSR1, previous)


class _SlowDumper(Dumper):
    """A dumper whose snapshot is taken only once the test says the client has gone."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(run_dir)
        self.asked = trio.Event()
        self.client_gone = trio.Event()

    async def snapshot(self) -> dict[str, Any]:
        self.asked.set()
        await self.client_gone.wait()
        return {"pid": os.getpid(), "padding": "x" * 1_000_000}  # more than a socket buffer


async def test_a_client_that_leaves_before_its_dump_costs_one_log_line(tmp_path, caplog):
    dumper = _SlowDumper(tmp_path)
    caplog.set_level("INFO", logger="trainer.debug")
    async with open_debug_services(dumper) as nursery:
        info = json.loads((tmp_path / DEBUG_FILE).read_text())
        client = await trio.open_unix_socket(info["socket"])
        await client.send_all(b"dump\n")
        await dumper.asked.wait()
        await client.aclose()
        dumper.client_gone.set()
        # the server answers the next client as before
        snapshot = await trio.to_thread.run_sync(request_dump, Path(info["socket"]), 60.0)
        nursery.cancel_scope.cancel()
    assert snapshot["pid"] == os.getpid()
    records = [r for r in caplog.records if r.name.startswith("trainer.debug")]
    assert [r.getMessage() for r in records] == [
        "debug socket: the client left before its dump was sent"
    ]
    assert all(r.exc_info is None for r in records)


def test_the_debug_files_of_processes_that_are_gone_are_removed(tmp_path):
    """A killed run cannot remove its PID.sock and PID.stacks; the next run's socket does."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    dead, alive = int(gone.stdout), os.getpid()
    names = [f"{dead}.sock", f"{dead}.stacks", f"{alive}.stacks", "notes.txt", "12x.stacks"]
    for name in names:
        (tmp_path / name).write_text("")
    assert remove_stale_debug_files(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
