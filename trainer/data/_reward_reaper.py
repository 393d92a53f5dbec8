"""What a reward worker may start, and how all of it is killed with the worker.

A worker (:mod:`trainer.data._reward_worker`) is the leader of its own session and process
group, and carries ``TRAINER_REWARD_WORKER=TOKEN`` (a token of its own) in its environment.
Whatever a reward function starts is found by :func:`kill_worker_tree` in three ways:

- its process group (the worker's pid): ``subprocess.Popen``, ``os.fork`` and their children;
- its session (the same id): a child that moved to a group of its own (``os.setpgid``);
- the token in ``/proc/PID/environ``: a child that left the session too (``os.setsid``,
  ``start_new_session=True``, a daemon's double fork) but kept the environment it inherited.

A process that leaves the session *and* changes its environment escapes (only a cgroup
could hold it, and there is none to create without privileges): rewards are the user's own
code, bounded against accidents, not confined against malice.

Two ways lead to :func:`kill_worker_tree`: the pool calls it whenever it kills or loses a
worker (a call past its timeout, a worker that died, the pool's end); and each worker forks
a *reaper* first thing (:func:`start_reaper`), a small process of its group that waits for
the worker's end however it comes (the trainer died and the kernel SIGKILLed the worker, a
reward called ``os._exit``) and then kills the rest, itself last.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
from pathlib import Path

__all__ = ["WORKER_TOKEN_ENV", "kill_worker_tree", "start_reaper"]

#: The variable whose value marks every process of one worker (its token).
WORKER_TOKEN_ENV = "TRAINER_REWARD_WORKER"


def _session(stat: str) -> int:
    """The session id in a ``/proc/PID/stat`` line (the command may hold spaces and ')')."""
    return int(stat[stat.rindex(")") + 2 :].split()[3])


def _is_member(entry: Path, session: int, marker: bytes | None) -> bool:
    """Whether process ``entry`` (``/proc/PID``) is in ``session`` or carries ``marker``."""
    if _session((entry / "stat").read_text()) == session:
        return True
    return marker is not None and marker in (entry / "environ").read_bytes().split(b"\0")


def _members(session: int, token: str) -> list[int]:
    """Live processes of the worker's session or carrying its token (this one left out)."""
    marker = f"{WORKER_TOKEN_ENV}={token}".encode() if token else None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if _is_member(entry, session, marker):
                found.append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile, or not ours to read
    return found


def kill_worker_tree(worker: int, token: str) -> None:
    """SIGKILL worker ``worker``'s process group, its session and every process carrying its
    ``token`` (module doc); what is gone already is no error. Blocking (it reads ``/proc``):
    call it from a thread."""
    for pid in _members(worker, token):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(worker, signal.SIGKILL)  # last: the group holds the caller when it is the reaper


def _reap_when_gone(worker: int, token: str) -> None:
    """In the reaper: let go of the worker's pipes, wait for its end, kill what is left."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the protocol's pipes: the trainer must see the worker's end alone
        os.dup2(null, fd)
    os.close(null)
    try:
        pidfd: int | None = os.pidfd_open(worker)
    except OSError:
        pidfd = None  # gone already
    if pidfd is not None and os.getppid() == worker:
        select.select([pidfd], [], [])
    kill_worker_tree(worker, token)  # this reaper too, with its group


def start_reaper(token: str) -> None:
    """Fork this worker's reaper (module doc); call it first thing, while the worker has a
    single thread. The reaper has no death signal of its own (``fork`` clears it), so the
    kernel's SIGKILL of the worker reaches it only through its own wait."""
    worker = os.getpid()
    if os.fork() == 0:
        try:
            _reap_when_gone(worker, token)
        finally:
            os._exit(0)
