"""A snapshot of a live run: every trio task, every busy thread, every engine server.

The snapshot is plain JSON data (it crosses the debug socket as it is)::

    {"pid": 4242, "run_dir": "runs/x", "taken_at": "2025-01-01T12:00:00",
     "step": {"step": 2, "running_s": 93.1},                # None between steps
     "tasks": {"name": "<init>", "step": None, "stage": None, "operation": None,
               "budget_s": None, "remaining_s": None, "deadline_error": None,
               "waiting_s": 0.1, "at": "trainer/loop/_steps.py:40 in run_training",
               "stack": [...], "children": [...]},
     "threads": [{"name": "worker:forward_backward", "ident": 1, "daemon": True,
                  "stack": ["trainer/workers/local.py:32 in _fire_then", ...]}],
     "idle_threads": 3,
     "engines": [{"url": "http://127.0.0.1:8000", "is_paused": False, ...}]}

The tasks and threads are read synchronously on the trio thread (:meth:`Dumper.local`), so
the tree is one consistent moment; the engines are asked afterwards, each bounded.
"""

from __future__ import annotations

import datetime
import os
import sys
import sysconfig
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TypedDict

import attrs
import trio

from engines.client import server_states
from trainer.debug._waits import WaitClock
from trainer.vocabulary import place_of

__all__ = [
    "Dumper",
    "RunningStep",
    "Snapshot",
    "TaskNode",
    "ThreadInfo",
    "task_tree",
    "thread_stacks",
]

#: Frames from these directories are the machinery, not the place a task waits at.
_MACHINERY = tuple(
    os.path.dirname(m.__file__ or "") + os.sep for m in (trio, traceback) if m.__file__
)


_STDLIB = sysconfig.get_paths()["stdlib"] + os.sep


class TaskNode(TypedDict):
    """One trio task of :func:`task_tree`: its :class:`~trainer.vocabulary.Place`, its wait."""

    name: str
    step: int | None
    stage: str | None
    operation: str | None
    budget_s: float | None
    remaining_s: float | None
    deadline_error: str | None
    #: Seconds since the task last ran (None without a wait clock).
    waiting_s: float | None
    #: The first frame of ours the task waits in (``file:line in name``), or None.
    at: str | None
    stack: list[str]
    children: list[TaskNode]


class ThreadInfo(TypedDict):
    """One busy thread of :func:`thread_stacks`, its stack innermost last."""

    name: str
    ident: int | None
    daemon: bool
    stack: list[str]


class RunningStep(TypedDict):
    """The step in progress when the snapshot was taken."""

    step: int
    running_s: float


class Snapshot(TypedDict):
    """What :meth:`Dumper.snapshot` returns (the module docstring shows one)."""

    pid: int
    run_dir: str
    taken_at: str
    step: RunningStep | None
    tasks: TaskNode
    threads: list[ThreadInfo]
    idle_threads: int
    #: One per engine server, as ``engines.client.server_states`` answers.
    engines: list[dict[str, object]]


def _frame_line(filename: str, lineno: int | None, name: str) -> str:
    return f"{_short(filename)}:{lineno} in {name}"


def _short(filename: str) -> str:
    """Our code relative to the working directory; a library's from its package; the
    standard library's by module file."""
    site = f"site-packages{os.sep}"
    if site in filename:
        return filename.split(site, 1)[1]
    if filename.startswith(_STDLIB):
        return filename[len(_STDLIB) :]
    try:
        rel = os.path.relpath(filename)
    except ValueError:
        return filename
    return filename if rel.startswith("..") else rel


def _ours(filename: str) -> bool:
    return not filename.startswith(_MACHINERY) and "site-packages" not in filename


def _at(frames: list[tuple[str, int | None, str]]) -> str | None:
    """The innermost frame in our code (or the innermost of all)."""
    for filename, lineno, name in reversed(frames):
        if _ours(filename):
            return _frame_line(filename, lineno, name)
    return _frame_line(*frames[-1]) if frames else None


def _task_node(task: trio.lowlevel.Task, clock: WaitClock | None, now: float) -> TaskNode:
    place = place_of(task.context)
    frames: list[tuple[str, int | None, str]] = [
        (f.f_code.co_filename, lineno, f.f_code.co_name) for f, lineno in task.iter_await_frames()
    ]
    children = [
        _task_node(child, clock, now)
        for nursery in task.child_nurseries
        for child in sorted(nursery.child_tasks, key=lambda t: t.name)
    ]
    return {
        "name": task.name,
        "step": place.step,
        "stage": place.stage,
        "operation": place.operation,
        "budget_s": place.budget_s,
        "remaining_s": place.remaining_s,
        "deadline_error": place.deadline_error,
        "waiting_s": clock.waited_s(task, now) if clock is not None else None,
        "at": _at(frames),
        "stack": [_frame_line(*f) for f in frames],
        "children": children,
    }


def task_tree(clock: WaitClock | None = None) -> TaskNode:
    """The whole trio task tree from the root task; call it on the trio thread.

    Each node has the task's name, its :class:`~trainer.vocabulary.Place` fields, how long
    it has waited (with a ``clock`` installed), where it waits and its children.
    """
    root = trio.lowlevel.current_root_task()
    if root is None:  # only while trio itself starts or stops
        raise RuntimeError("no trio task tree to walk: trio is starting or stopping")
    return _task_node(root, clock, trio.current_time())


def _idle_pool_thread(stack: traceback.StackSummary) -> bool:
    """A trio worker thread waiting for a job (it has none): noise in a dump."""
    names = {f.name for f in stack}
    return (
        "_work" in names
        and "_handle_job" not in names
        and any("_thread_cache" in f.filename for f in stack)
    )


def thread_stacks() -> tuple[list[ThreadInfo], int]:
    """(every busy thread but this one with its stack, innermost last; idle pool threads)."""
    frames = sys._current_frames()  # noqa: SLF001 - the documented way to see other threads
    me = threading.get_ident()
    busy: list[ThreadInfo] = []
    idle = 0
    for thread in threading.enumerate():
        frame = frames.get(thread.ident or -1)
        if frame is None or thread.ident == me:
            continue
        stack = traceback.extract_stack(frame)
        if _idle_pool_thread(stack):
            idle += 1
            continue
        busy.append(
            {
                "name": thread.name,
                "ident": thread.ident,
                "daemon": thread.daemon,
                "stack": [
                    _frame_line(f.filename, f.lineno, f.name) + (f": {f.line}" if f.line else "")
                    for f in stack
                ],
            }
        )
    return busy, idle


@attrs.define(eq=False)
class Dumper:
    """What a dump of this run reads: the wait clock, the engine servers, the running step.

    The run fills ``engine_urls`` once its engines are up and gives ``running_step`` (the
    watchdog's) so a dump says how long the current step has run.
    """

    run_dir: Path
    #: Installed as a trio instrument for the run (``trio.lowlevel.add_instrument``).
    clock: WaitClock = attrs.Factory(WaitClock)
    #: Base URLs of the engine servers to ask for their state (none: in-process engine).
    engine_urls: tuple[str, ...] = ()
    engine_api_key: str | None = None
    #: Bound of each server's answer.
    engine_timeout_s: float = 2.0
    #: ``(step, seconds it has run)`` of the step in progress, or None between steps.
    running_step: Callable[[], tuple[int, float] | None] = lambda: None

    def local(self) -> Snapshot:
        """Tasks and threads, now, without awaiting (the engines are left out)."""
        threads, idle = thread_stacks()
        running = self.running_step()
        return {
            "pid": os.getpid(),
            "run_dir": str(self.run_dir),
            "taken_at": datetime.datetime.now().isoformat(timespec="seconds"),
            "step": None if running is None else {"step": running[0], "running_s": running[1]},
            "tasks": task_tree(self.clock),
            "threads": threads,
            "idle_threads": idle,
            "engines": [],
        }

    async def snapshot(self) -> Snapshot:
        """:meth:`local`, then the state of each engine server (bounded; see ``server_states``).

        Cancellation propagates; the tasks and threads are from before the engines were asked.
        """
        snap = self.local()
        if self.engine_urls:
            snap["engines"] = await server_states(
                self.engine_urls, api_key=self.engine_api_key, timeout_s=self.engine_timeout_s
            )
        return snap
