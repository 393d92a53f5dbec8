"""Child processes that die with this process however it dies: :func:`open_child`.

::

    child = await open_child(argv, stdin=subprocess.PIPE, stdout=log_file, env=env,
                             start_new_session=True)
    await child.stdin.send_all(b"...")
    code = await child.wait()

Each child runs under :mod:`engines.launch.parent_death` (``PR_SET_PDEATHSIG``, set by the
child before it runs anything of its own), so it gets its death signal (SIGKILL unless told)
when this process exits, SIGKILLed or crashed included, even in the middle of its imports.

Linux sends that signal when the *thread* that forked the child exits, not the process.
``trio.lowlevel.open_process`` forks from a ``trio.to_thread`` worker, and trio ends an idle
worker after 10 s: a child armed that way is killed 10 s after its start. So every child here
is forked by one thread, started on first use and alive until this process ends (a fresh one
after ``fork``); trio waits for it in a worker thread, which is free to come and go.

A :class:`ChildProcess` offers what the launchers and the reward pool use of a
``trio.Process``: ``pid``, ``returncode``, ``poll()``, ``await wait()``, ``stdin`` and
``stdout`` (trio streams, for the pipes asked for).
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Any, cast

import trio

from engines.launch import parent_death

__all__ = ["ChildProcess", "open_child"]

#: Seconds between two looks at a child's state where there is no pidfd (not Linux).
_POLL_S = 0.05

_spawner: tuple[int, ThreadPoolExecutor] | None = None
_spawner_lock = threading.Lock()


def _reset_after_fork() -> None:
    global _spawner, _spawner_lock
    _spawner, _spawner_lock = None, threading.Lock()  # the thread did not come along


os.register_at_fork(after_in_child=_reset_after_fork)


def _spawner_thread() -> ThreadPoolExecutor:
    """The one thread (per process) that forks every child of :func:`open_child`."""
    global _spawner
    with _spawner_lock:
        if _spawner is None or _spawner[0] != os.getpid():
            _spawner = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="child-spawner"))
        return _spawner[1]


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class ChildProcess:
    """A child started by :func:`open_child` (see the module doc). Its exit is read from a
    pidfd where there is one (Linux 5.3 and later), else by polling."""

    def __init__(
        self,
        popen: subprocess.Popen[bytes],
        pidfd: int | None,
        stdin: trio.lowlevel.FdStream | None,
        stdout: trio.lowlevel.FdStream | None,
    ) -> None:
        self._popen = popen
        self._pidfd = pidfd
        self._wait_lock = trio.Lock()
        #: The write end of its stdin pipe (``stdin=subprocess.PIPE``), else None.
        self.stdin = stdin
        #: The read end of its stdout pipe (``stdout=subprocess.PIPE``), else None.
        self.stdout = stdout

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def returncode(self) -> int | None:
        """Its exit status once reaped (``-N``: killed by signal ``N``), else None."""
        return self._popen.returncode

    def poll(self) -> int | None:
        """Reap it if it has exited: its exit status, or None while it runs."""
        code = self._popen.poll()
        if code is not None and self._pidfd is not None:
            fd, self._pidfd = self._pidfd, None
            trio.lowlevel.notify_closing(fd)
            os.close(fd)
        return code

    async def wait(self) -> int:
        """Wait until it exits and reap it: its exit status. Cancellable; several tasks may
        wait at once."""
        async with self._wait_lock:
            while (code := self.poll()) is None:
                if self._pidfd is None:
                    await trio.sleep(_POLL_S)
                else:
                    await trio.lowlevel.wait_readable(self._pidfd)
            return code

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to it (nothing once it is reaped)."""
        self._popen.send_signal(sig)


def _start(
    argv: list[str], sig: int, kwargs: dict[str, Any]
) -> tuple[subprocess.Popen[bytes], int | None]:
    """In the spawner thread: fork ``argv`` under :mod:`parent_death`, and its pidfd."""
    popen = cast(
        "subprocess.Popen[bytes]", subprocess.Popen(parent_death.command(argv, sig=sig), **kwargs)
    )
    return popen, _pidfd(popen.pid)


async def _shielded_result(
    future: Future[tuple[subprocess.Popen[bytes], int | None]],
) -> tuple[subprocess.Popen[bytes], int | None]:
    """The spawner's answer, shielded: ``to_thread`` checks for a cancel before it waits, and a
    fork already asked for must come back to its owner (dropped, its child would run on
    untracked)."""
    result = None
    with trio.CancelScope(shield=True):  # never cancelled: it only shields
        result = await trio.to_thread.run_sync(future.result)
    assert result is not None
    return result


async def open_child(
    argv: Sequence[str],
    *,
    stdin: int | IO[Any] | None = None,
    stdout: int | IO[Any] | None = None,
    stderr: int | IO[Any] | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    start_new_session: bool = False,
    death_signal: int = signal.SIGKILL,
) -> ChildProcess:
    """Start ``argv`` as a child that gets ``death_signal`` when this process dies (module doc).

    ``stdin``/``stdout``/``stderr`` as :class:`subprocess.Popen` takes them; ``subprocess.PIPE``
    for ``stdin`` or ``stdout`` gives the child's ``stdin``/``stdout`` trio stream. Not
    cancellable once the fork is asked for (a started child is always returned, so that its
    owner can stop it). ``OSError`` when ``argv`` cannot be started.
    """
    opened: list[int] = []  # the child's ends, closed here once it has them
    ours: list[trio.lowlevel.FdStream] = []
    trio_stdin = trio_stdout = None
    if stdin == subprocess.PIPE:
        read_end, write_end = os.pipe()
        stdin, trio_stdin = read_end, trio.lowlevel.FdStream(write_end)
        opened.append(read_end)
        ours.append(trio_stdin)
    if stdout == subprocess.PIPE:
        read_end, write_end = os.pipe()
        stdout, trio_stdout = write_end, trio.lowlevel.FdStream(read_end)
        opened.append(write_end)
        ours.append(trio_stdout)
    kwargs: dict[str, Any] = {
        "stdin": stdin,
        "stdout": stdout,
        "stderr": stderr,
        "env": None if env is None else dict(env),
        "cwd": cwd,
        "start_new_session": start_new_session,
    }
    try:
        await trio.lowlevel.checkpoint_if_cancelled()  # a cancelled caller forks nothing
        future = _spawner_thread().submit(_start, list(argv), death_signal, kwargs)
        started = await _shielded_result(future)
    except BaseException:
        for stream in ours:
            stream.close()
        raise
    finally:
        for fd in opened:
            os.close(fd)
    popen, pidfd = started
    return ChildProcess(popen, pidfd, trio_stdin, trio_stdout)
