"""How a process sizes its torch thread pool on a shared machine (engines.cpu_share): the
policy against hand-made readings, and the readings against this process's real threads."""

from __future__ import annotations

import os
import threading
import time

import pytest

from engines.cpu_share import (
    MAX_PROBE_AFTER,
    SHRINK_AT,
    CpuShare,
    available_cores,
    own_thread_id,
    thread_times,
)


class Readings:
    """A clock and a schedstat reader driven by the test: each window adds ``run`` and
    ``wait`` seconds of thread time to thread 1."""

    def __init__(self) -> None:
        self.now = 0.0
        self.run_ns = 0
        self.wait_ns = 0

    def clock(self) -> float:
        return self.now

    def read(self) -> dict[int, tuple[int, int]]:
        return {1: (self.run_ns, self.wait_ns)}

    def window(self, share: CpuShare, run: float, wait: float) -> int:
        self.now += 1.0
        self.run_ns += int(run * 1e9)
        self.wait_ns += int(wait * 1e9)
        return share.threads()


def test_contention_takes_a_thread_away_and_a_quiet_probe_gives_it_back() -> None:
    r = Readings()
    share = CpuShare(2, window_s=1.0, probe_after=3, clock=r.clock, read=r.read)
    assert share.threads() == 2  # no window closed yet
    assert r.window(share, run=1.0, wait=0.02) == 2  # an idle machine's few percent
    assert r.window(share, run=1.0, wait=0.5) == 1  # a third of the ready time waiting
    assert share.waiting == pytest.approx(0.5 / 1.5)
    # quiet at one thread: after probe_after windows, one more to see whether cores are free
    assert [r.window(share, 1.0, 0.0) for _ in range(3)] == [1, 1, 2]
    assert r.window(share, 1.0, 0.01) == 2  # they were: it stays
    assert r.window(share, 1.0, 0.0) == 2  # and never above its cores


def test_a_probe_that_meets_contention_waits_twice_as_long_before_the_next() -> None:
    r = Readings()
    share = CpuShare(2, window_s=1.0, probe_after=2, clock=r.clock, read=r.read)
    assert share.threads() == 2  # the first call opens the first window
    assert r.window(share, 1.0, 1.0) == 1
    waits = []
    for _ in range(4):  # each probe meets the busy cores again
        quiet = 0
        while r.window(share, 1.0, 0.0) == 1:
            quiet += 1
        waits.append(quiet + 1)
        assert r.window(share, 1.0, 1.0) == 1
    assert waits == [2, 4, 8, 16]
    assert MAX_PROBE_AFTER >= 16


def test_a_window_with_too_little_work_decides_nothing() -> None:
    r = Readings()
    share = CpuShare(2, window_s=1.0, clock=r.clock, read=r.read)
    assert share.threads() == 2
    assert r.window(share, run=0.001, wait=0.01) == 2  # 91% waiting, but 11 ms of work
    assert share.waiting is None
    assert r.window(share, run=0.1, wait=0.1) == 1


def test_a_single_thread_pool_and_a_missing_schedstat_leave_the_count_alone() -> None:
    r = Readings()
    one = CpuShare(1, clock=r.clock, read=r.read)
    assert r.window(one, 1.0, 5.0) == 1
    blind = CpuShare(4, window_s=1.0, clock=r.clock, read=lambda: None)
    assert blind.threads() == 4
    assert r.window(blind, 1.0, 5.0) == 4


def test_the_threshold_sits_between_an_idle_machine_and_one_lost_core() -> None:
    # two threads beside one busy process on two cores: each waits about a third of its time
    assert 0.05 < SHRINK_AT < 1 / 3


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="Linux's /proc")
def test_a_spinning_thread_adds_to_the_process_time_on_a_cpu() -> None:
    """The readings are this process's real threads: a thread that spins for 0.2 s adds
    about that much time on a CPU (the sum over the threads /proc lists; thread ids are
    not compared, as a PID namespace may number them differently from /proc)."""
    before = thread_times()
    assert before is not None and all(r >= 0 and w >= 0 for r, w in before.values())
    spun, done = threading.Event(), threading.Event()

    def spin() -> None:  # spins 0.2 s, says so, and spins on until read (a finished thread
        started = time.monotonic()  # leaves /proc/self/task)
        while not done.is_set():
            if time.monotonic() - started >= 0.2:
                spun.set()

    t = threading.Thread(target=spin)
    t.start()
    try:
        assert spun.wait(timeout=60)
        during = thread_times()
    finally:
        done.set()
        t.join()
    assert during is not None
    gained = sum(r for r, _ in during.values()) - sum(r for r, _ in before.values())
    assert gained > 0.05e9


@pytest.mark.skipif(not os.path.exists("/proc/thread-self"), reason="Linux's /proc")
def test_a_thread_left_out_is_not_read() -> None:
    """The trainer leaves its event loop's thread out of its readings: that thread is found
    by the id /proc numbers it with, and is then absent."""
    me = own_thread_id()
    everything, without = thread_times(), thread_times(exclude=(me,))
    assert everything is not None and without is not None
    assert me in everything and me not in without


def test_the_cores_are_omp_num_threads_else_the_affinity(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert available_cores() == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert available_cores() == len(os.sched_getaffinity(0))
