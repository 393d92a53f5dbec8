"""The clients of a fork server (:mod:`engines.launch.fork_server`, which says what it is and
its protocol): :func:`fork_process` for trio (the launchers), :func:`fork_popen` for blocking
code (tests, scripts), :func:`list_children`.

Apart from the server's module so that the package imports the clients without the runnable
module (``python -m engines.launch.fork_server`` must find it unimported).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from trainer.errors import ForkServerError

__all__ = [
    "FORK_SERVER_READY",
    "MAX_MESSAGE",
    "ForkedPopen",
    "ForkedProcess",
    "fork_popen",
    "fork_process",
    "forkable",
    "list_children",
    "python_prefix",
]

#: The line the server prints to stdout once it listens.
FORK_SERVER_READY = "FORK_SERVER_READY"
#: The longest message either side sends.
MAX_MESSAGE = 1 << 20
#: Seconds a request may take to be answered (a fork answers in milliseconds).
REQUEST_TIMEOUT_S = 30.0


def python_prefix() -> str:
    """This Python's installation or virtual environment (the real path of ``sys.prefix``):
    what a fork server and its client must share."""
    return os.path.realpath(sys.prefix)


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is this Python running a module (``sys.executable -m MODULE ...``),
    the only command a fork server started by this Python can run."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


def _request(socket_path: str, message: dict[str, Any], fds: Sequence[int]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.settimeout(REQUEST_TIMEOUT_S)  # until its answer; a hung server is an error
    try:
        sock.connect(socket_path)
        socket.send_fds(sock, [json.dumps(message).encode()], list(fds))
    except OSError as exc:
        sock.close()
        raise ForkServerError(socket_path, f"cannot be reached ({exc})") from exc
    return sock


def _spawn_message(argv: Sequence[str], env: Mapping[str, str], cwd: str | Path) -> dict[str, Any]:
    if not forkable(argv):
        raise ValueError(f"only `{sys.executable} -m MODULE ...` can be forked, got {argv[:3]}")
    return {
        "kind": "spawn",
        "python": python_prefix(),
        "argv": list(argv[1:]),
        "env": dict(env),
        "cwd": str(cwd),
    }


def _reply(socket_path: str, sock: socket.socket) -> dict[str, Any]:
    """The server's answer to a request, within :data:`REQUEST_TIMEOUT_S`."""
    try:
        data = sock.recv(MAX_MESSAGE)
    except OSError as exc:
        sock.close()
        raise ForkServerError(socket_path, f"did not answer ({exc})") from exc
    return json.loads(data or b'{"error": "it closed the connection"}')


def _pid_of(socket_path: str, sock: socket.socket) -> int:
    reply = _reply(socket_path, sock)
    if "pid" not in reply:
        sock.close()
        raise ForkServerError(socket_path, reply.get("error", f"unexpected reply {reply}"))
    sock.settimeout(None)  # from now on it waits for the child's exit, as long as that takes
    return int(reply["pid"])


def list_children(socket_path: str, env_name: str) -> list[tuple[int, str | None]]:
    """The fork server's live children: each pid with the value of ``env_name`` it was given."""
    with _request(socket_path, {"kind": "list", "env": env_name}, []) as sock:
        reply = _reply(socket_path, sock)
    return [(int(pid), value) for pid, value in reply["children"]]


class _ExitStatus:
    """A fork server child's exit status, read from its connection: ``pid``, ``returncode``
    and ``poll()``. Its process group is its own (``pgid == pid``)."""

    def __init__(self, pid: int, sock: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._sock = sock

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                data = self._sock.recv(MAX_MESSAGE, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            # no message: the server went away without a word; the child's status is unknown
            self.returncode = json.loads(data)["returncode"] if data else -signal.SIGKILL
            self._sock.close()
        return self.returncode


class ForkedProcess(_ExitStatus):
    """A child of a fork server, seen from trio: what the launchers use of a ``trio.Process``
    (``pid``, ``returncode``, ``poll()``, ``wait()``, ``stdin``)."""

    def __init__(self, pid: int, sock: socket.socket, stdin: trio.lowlevel.FdStream) -> None:
        super().__init__(pid, sock)
        self.stdin = stdin

    async def wait(self) -> int:
        while (code := self.poll()) is None:
            await trio.lowlevel.wait_readable(self._sock)
        return code


async def fork_process(
    socket_path: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path,
    stdout: int,
    stderr: int,
) -> ForkedProcess:
    """Start ``argv`` (``sys.executable -m MODULE ...``) as a child of the fork server at
    ``socket_path``, in a session of its own, with a pipe on its stdin (the returned process's
    ``stdin``) and ``stdout``/``stderr`` those descriptors. :class:`ForkServerError` when the
    server cannot be reached or refuses."""
    message = _spawn_message(argv, env, cwd)
    read_end, write_end = os.pipe()
    try:

        def spawn() -> tuple[int, socket.socket]:
            sock = _request(socket_path, message, [read_end, stdout, stderr])
            return _pid_of(socket_path, sock), sock

        pid, sock = await trio.to_thread.run_sync(spawn)
    except BaseException:
        os.close(write_end)
        raise
    finally:
        os.close(read_end)  # the child holds its own
    return ForkedProcess(pid, sock, trio.lowlevel.FdStream(write_end))


class ForkedPopen(_ExitStatus):
    """A child of a fork server, seen from blocking code: what tests use of a
    ``subprocess.Popen`` (``pid``, ``returncode``, ``poll()``, ``wait(timeout)``,
    ``send_signal()``, ``kill()``)."""

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            select.select([self._sock], [], [], left)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


P = TypeVar("P", bound=ForkedPopen)


def fork_popen(
    socket_path: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: str | Path,
    stdin: int,
    stdout: int,
    stderr: int,
    cls: type[P] = ForkedPopen,
) -> P:
    """:func:`fork_process` for blocking code, with the three descriptors given: a ``cls``."""
    sock = _request(socket_path, _spawn_message(argv, env, cwd), [stdin, stdout, stderr])
    return cls(_pid_of(socket_path, sock), sock)
