"""The torch threads a process can really use on a machine it shares: :class:`CpuShare`.

A torch intra-op pool of N threads meets at a barrier after each parallel kernel, so while
another process holds one of the cores, every kernel waits for the thread that lost its core.
On the two-core machine, beside two busy processes, the default run took 3.9x its idle time
with two threads and 1.5x with one (docs/performance.md, "A shared machine"). So a process
asks, between units of work, how long its threads waited for a CPU while they were ready to
run (Linux's per-thread ``schedstat``: nanoseconds on a CPU, nanoseconds waiting on a run
queue), and sizes its pool by that:

- a window in which more than :data:`SHRINK_AT` of its threads' ready time went to waiting:
  one thread fewer (not below one);
- below its cores, after ``probe_after`` quiet windows in a row: one thread more, to learn
  whether the cores are free again; a probe that meets contention at once doubles the quiet
  windows the next probe waits for (up to :data:`MAX_PROBE_AFTER`).

Each unit of work calls :meth:`CpuShare.threads` in the thread that runs it (torch's thread
count is per thread) and sets ``torch.set_num_threads`` to the answer; a window is at least
``window_s`` long, and one with too little work in it (:data:`MIN_BUSY_S` of thread time)
decides nothing. Where ``/proc`` has no ``schedstat`` (not Linux), the count stays at its
cores. Torch-free.

A process whose event loop works while its torch threads rest reads its threads but that one
(``thread_times(exclude=...)``): the trainer's trio thread runs the generators' HTTP streams
while an engine server holds the cores, and its waiting then is not the update's. Measured
2026-12-05, before it was left out: a window over an eval's 9 s of sampling took a thread from
the SmolLM2 recipe's update for 35 s on an otherwise idle machine.

The cores are what :func:`available_cores` says: ``OMP_NUM_THREADS`` where it is set, else the
process's CPU affinity (``os.sched_getaffinity``: a container or ``taskset`` limits it), else
the machine's count.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path

__all__ = [
    "MAX_PROBE_AFTER",
    "MIN_BUSY_S",
    "SHRINK_AT",
    "CpuShare",
    "available_cores",
    "own_thread_id",
    "thread_times",
]

log = logging.getLogger("engines.cpu_share")

#: The share of its threads' ready time a process may spend waiting for a CPU before it
#: gives up a thread (an idle machine shows a few percent; one busy process beside two
#: threads on two cores, about a third).
SHRINK_AT = 0.15
#: A window with less thread time than this (on a CPU or waiting) decides nothing.
MIN_BUSY_S = 0.05
#: The most quiet windows a probe waits for.
MAX_PROBE_AFTER = 64


def available_cores() -> int:
    """The cores this process may use: ``OMP_NUM_THREADS`` where set (a positive whole
    number), else its CPU affinity, else the machine's count."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    if value.isdigit() and int(value) > 0:
        return int(value)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def thread_times(
    task_dir: Path = Path("/proc/self/task"), exclude: Collection[int] = ()
) -> dict[int, tuple[int, int]] | None:
    """Each thread of this process but those in ``exclude`` (native ids): (ns on a CPU, ns
    ready but waiting for one), from ``/proc/self/task/TID/schedstat``; None where there is no
    such file (not Linux, or schedstats off). Blocking (reads ``/proc``): call it off the trio
    thread."""
    times: dict[int, tuple[int, int]] = {}
    try:
        tasks = [t for t in task_dir.iterdir() if int(t.name) not in exclude]
    except OSError:
        return None
    for task in tasks:
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:  # the thread ended meanwhile
            continue
        if len(fields) >= 2:
            times[int(task.name)] = (int(fields[0]), int(fields[1]))
    return times or None


def own_thread_id() -> int:
    """The calling thread's id as ``/proc/self/task`` numbers it (``/proc/thread-self``; a PID
    namespace may number it otherwise than ``threading.get_native_id``, the fallback where
    there is no such link)."""
    try:
        return int(os.readlink("/proc/thread-self").rsplit("/", 1)[1])
    except (OSError, ValueError):
        return threading.get_native_id()


class CpuShare:
    """The thread count for this process's next unit of work (see the module docstring).

    ``max_threads``: the most it uses (its share of :func:`available_cores`). Thread-safe:
    the units of work that ask may run in different threads.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        window_s: float = 1.0,
        probe_after: int = 4,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], dict[int, tuple[int, int]] | None] = thread_times,
    ) -> None:
        self.max_threads = max(1, max_threads)
        #: The count now.
        self.current = self.max_threads
        #: The last window's share of ready time spent waiting (None before one decided).
        self.waiting: float | None = None
        self._window_s = window_s
        self._probe_after = self._base_probe_after = probe_after
        self._quiet = 0
        self._probing = False
        self._clock = clock
        self._read = read
        self._lock = threading.Lock()
        self._since = clock()
        #: The readings the window opened with; None until the first unit of work asks (so
        #: the constructor reads no ``/proc``: it may run on the trio thread).
        self._last: dict[int, tuple[int, int]] | None = None
        self._primed = False

    def threads(self) -> int:
        """The count for the next unit of work, after closing the window if it is due (the
        first call opens the first window). Blocking (reads ``/proc``): call it in the thread
        that runs the work."""
        with self._lock:
            if self.max_threads > 1 and not self._primed:
                self._last, self._since, self._primed = self._read(), self._clock(), True
            elif self.max_threads > 1 and self._clock() - self._since >= self._window_s:
                self._close_window()
            return self.current

    def _close_window(self) -> None:
        now = self._read()
        before, self._last, self._since = self._last, now, self._clock()
        if now is None or before is None:
            return
        ran = waited = 0
        for tid, (run_ns, wait_ns) in now.items():
            if tid in before:
                ran += run_ns - before[tid][0]
                waited += wait_ns - before[tid][1]
        if ran + waited < MIN_BUSY_S * 1e9:
            return  # too little work to tell
        self.waiting = waited / (ran + waited)
        self._decide(self.waiting)

    def _decide(self, waiting: float) -> None:
        if waiting > SHRINK_AT:
            if self._probing:  # the cores were not free: wait longer before the next probe
                self._probe_after = min(MAX_PROBE_AFTER, self._probe_after * 2)
            self._set(max(1, self.current - 1), waiting)
            self._quiet, self._probing = 0, False
            return
        if self._probing:  # the probe found the cores free
            self._probe_after = self._base_probe_after
        self._probing = False
        self._quiet += 1
        if self.current < self.max_threads and self._quiet >= self._probe_after:
            self._set(self.current + 1, waiting)
            self._quiet, self._probing = 0, True

    def _set(self, threads: int, waiting: float) -> None:
        if threads != self.current:
            log.info(
                "torch threads %d -> %d: %.0f%% of the threads' ready time went to waiting "
                "for a CPU",
                self.current,
                threads,
                100 * waiting,
            )
        self.current = threads
