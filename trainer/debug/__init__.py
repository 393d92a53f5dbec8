"""Seeing inside a live run: task-tree dumps, the debug socket, the stall instrument.

- :class:`Dumper` takes a :func:`snapshot <Dumper.snapshot>` of the run: every trio task with
  its step, stage, operation, deadline and wait; every busy thread's stack; each engine
  server's state. :func:`render` prints it as a tree, :func:`where_line` says in one line
  where the run is.
- :func:`serve_debug_socket` answers ``python -m trainer debug dump PID|RUN_DIR``
  (:func:`request_dump`); :func:`stack_signal` makes ``SIGUSR1`` write every thread's stack
  when the event loop itself is blocked. Their folder under ``$TMPDIR`` is private:
  :func:`private_dir` makes or checks it, refusing one another user may control
  (:class:`UnsafePathError`).
- :class:`Watchdog` writes the dump when a step runs far longer than usual, and just before
  a step's deadline fails it.
- :class:`StallInstrument` measures the event loop's longest stall per step
  (``loop/max_stall_ms``) or over one block (:class:`StallWindow`); :class:`WaitClock` how
  long each task has waited.
"""

from trainer.debug._cli import debug_main as debug_main
from trainer.debug._private import UnsafePathError as UnsafePathError
from trainer.debug._private import private_dir as private_dir
from trainer.debug._render import innermost_place as innermost_place
from trainer.debug._render import render as render
from trainer.debug._render import tree_of as tree_of
from trainer.debug._render import where_line as where_line
from trainer.debug._server import DEBUG_FILE as DEBUG_FILE
from trainer.debug._server import debug_paths as debug_paths
from trainer.debug._server import request_dump as request_dump
from trainer.debug._server import serve_debug_socket as serve_debug_socket
from trainer.debug._server import stack_signal as stack_signal
from trainer.debug._service import open_debug_services as open_debug_services
from trainer.debug._snapshot import Dumper as Dumper
from trainer.debug._snapshot import task_tree as task_tree
from trainer.debug._snapshot import thread_stacks as thread_stacks
from trainer.debug._stalls import StallInstrument as StallInstrument
from trainer.debug._stalls import StallWindow as StallWindow
from trainer.debug._waits import WaitClock as WaitClock
from trainer.debug._watchdog import Watchdog as Watchdog

__all__ = [
    "DEBUG_FILE",
    "Dumper",
    "StallInstrument",
    "StallWindow",
    "UnsafePathError",
    "WaitClock",
    "Watchdog",
    "debug_main",
    "debug_paths",
    "innermost_place",
    "open_debug_services",
    "private_dir",
    "render",
    "request_dump",
    "serve_debug_socket",
    "stack_signal",
    "task_tree",
    "thread_stacks",
    "tree_of",
    "where_line",
]
