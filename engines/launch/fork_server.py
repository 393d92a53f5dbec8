"""A fork server: one process that imported the heavy modules once and forks servers from itself.

::

    python -m engines.launch.fork_server --socket /tmp/fs.sock --preload engines.local.__main__

Starting a reference server (``python -m engines.local serve``) costs about 5 s of CPU before
it does anything: importing torch, transformers and hypercorn. A fork server pays that once;
each server it starts is a ``fork`` of it, running ``python -m MODULE ARGS`` as a fresh
interpreter would (its own session, its own stdin/stdout/stderr, environment and working
directory), in well under a second. The launchers use it for the reference servers of a run
when ``engine.fork_server`` (env ``TRAINER_FORK_SERVER``) names its socket
(:func:`fork_process`); the test suite runs ``python -m trainer`` through one
(:func:`fork_popen`).

The protocol: a Unix ``SOCK_SEQPACKET`` socket; one connection per child. The client sends
one JSON message, with the child's stdin, stdout and stderr as three file descriptors
(``SCM_RIGHTS``)::

    {"kind": "spawn", "executable": sys.executable, "argv": ["-m", MODULE, *ARGS],
     "env": {...}, "cwd": DIR}

and gets ``{"pid": N}`` once forked (or ``{"error": TEXT}``), then ``{"returncode": R}`` when
the child exits (``-N`` for a signal N, as :mod:`subprocess` says it). ``{"kind": "list",
"env": NAME}`` answers ``{"children": [[pid, value-of-NAME-or-null], ...]}``: the live
children, which ``/proc/PID/environ`` cannot tell apart (a forked child shows its parent's
environment there).

How it differs from a fresh ``python``: modules already imported here are not imported again
(their import-time state, such as a variable read at import, is the fork server's), and the
child's ``sys.path`` is the fork server's plus the child's ``PYTHONPATH``. Only this Python
(``executable``) is forked; anything else is refused. It ends when its stdin reaches
end-of-file (its owner died or closed it) or on SIGTERM, once its children have exited; the
children are in sessions of their own and end as their own owners decide.

Nothing here is trio: the server is a separate, single-purpose process (a selector loop); the
trio client does its one blocking ``sendmsg`` in a thread.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import runpy
import select
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from trainer.errors import ForkServerError

__all__ = [
    "FORK_SERVER_READY",
    "ForkedPopen",
    "ForkedProcess",
    "fork_popen",
    "fork_process",
    "forkable",
    "list_children",
    "main",
]

#: The line the server prints to stdout once it listens.
FORK_SERVER_READY = "FORK_SERVER_READY"
_MAX_MESSAGE = 1 << 20


def forkable(argv: Sequence[str]) -> bool:
    """Whether ``argv`` is this Python running a module (``sys.executable -m MODULE ...``),
    the only command a fork server started by this Python can run."""
    return len(argv) >= 3 and argv[0] == sys.executable and argv[1] == "-m"


# ---- the server -------------------------------------------------------------------------------


@attrs.define
class _Child:
    """What a forked child runs, once it has left the server's loop."""

    argv: list[str]
    env: dict[str, str]
    cwd: str


def _send(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:
        pass  # the client went away; the child runs on


class _Server:
    def __init__(self, listener: socket.socket) -> None:
        self.pid = os.getpid()
        self.listener = listener
        self.selector = selectors.DefaultSelector()
        self.selector.register(listener, selectors.EVENT_READ, "accept")
        self.selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "stdin")
        # SIGTERM wakes the loop through this pair (a handler must not touch the selector)
        self.wakeup, wakeup_w = socket.socketpair()
        self.wakeup_w = wakeup_w
        wakeup_w.setblocking(False)
        signal.set_wakeup_fd(wakeup_w.fileno())
        self.selector.register(self.wakeup, selectors.EVENT_READ, "signal")
        self.terminated = False
        #: pidfd -> (pid, its connection or None once the client left, its env)
        self.children: dict[int, tuple[int, socket.socket | None, dict[str, str]]] = {}
        self.stopping = False

    def run(self) -> _Child | None:
        """Serve until told to stop and every child has exited (None), or, in a forked
        child, return what the child runs."""
        while not (self.stopping and not self.children):
            for key, _ in self.selector.select():
                child = self._handle(key)
                if child is not None:
                    return child
        return None

    def stop(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.selector.unregister(self.listener)
            self.listener.close()
            self.selector.unregister(sys.stdin.fileno())

    def _handle(self, key: selectors.SelectorKey) -> _Child | None:
        if key.data == "accept":
            conn, _ = self.listener.accept()
            self.selector.register(conn, selectors.EVENT_READ, "request")
        elif key.data == "stdin":
            if not os.read(sys.stdin.fileno(), 4096):
                self.stop()
        elif key.data == "signal":
            self.wakeup.recv(4096)
            if self.terminated:
                self.stop()
        elif key.data == "request":
            return self._request(key.fileobj)  # type: ignore[arg-type]
        else:  # a child's pidfd: it exited
            self._reap(key.fd)
        return None

    def _request(self, conn: socket.socket) -> _Child | None:
        try:
            data, fds, _, _ = socket.recv_fds(conn, _MAX_MESSAGE, 3)
        except OSError:
            data, fds = b"", []
        self.selector.unregister(conn)
        if not data:  # the client left before (or after) its child exited
            self._forget(conn)
            conn.close()
            return None
        try:
            message = json.loads(data)
            if message.get("kind") == "list":
                name = message["env"]
                listed = [[pid, env.get(name)] for pid, _, env in self.children.values()]
                _send(conn, {"children": listed})
                conn.close()
                return None
            return self._spawn(conn, message, fds)
        finally:
            if os.getpid() == self.pid:  # the server's copies (a child has made its own)
                for fd in fds:
                    os.close(fd)

    def _spawn(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> _Child | None:
        if self.stopping:
            _send(conn, {"error": "the fork server is stopping"})
            conn.close()
            return None
        if message.get("executable") != sys.executable or len(fds) != 3:
            reason = f"it forks only {sys.executable} with stdin, stdout and stderr"
            _send(conn, {"error": reason})
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return self._become_child(conn, message, fds)
        self.selector.register(conn, selectors.EVENT_READ, "request")
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, conn, dict(message["env"]))
        self.selector.register(pidfd, selectors.EVENT_READ, "child")
        _send(conn, {"pid": pid})
        return None

    def _become_child(self, conn: socket.socket, message: dict[str, Any], fds: list[int]) -> _Child:
        os.setsid()
        for sig in (signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            if fd > 2:
                os.close(fd)
        conn.close()
        signal.set_wakeup_fd(-1)
        self.wakeup.close()
        self.wakeup_w.close()
        self.selector.close()
        if not self.stopping:
            self.listener.close()
        for pidfd, (_, other, _) in self.children.items():
            os.close(pidfd)
            if other is not None:
                other.close()
        return _Child(list(message["argv"]), dict(message["env"]), str(message["cwd"]))

    def _forget(self, conn: socket.socket) -> None:
        for pidfd, (pid, other, env) in self.children.items():
            if other is conn:
                self.children[pidfd] = (pid, None, env)

    def _reap(self, pidfd: int) -> None:
        pid, conn, _ = self.children.pop(pidfd)
        self.selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if conn is not None:
            self.selector.unregister(conn)
            _send(conn, {"returncode": os.waitstatus_to_exitcode(status)})
            conn.close()


def _std_streams(env: Mapping[str, str]) -> None:
    """``sys.stdin``/``stdout``/``stderr`` opened afresh on descriptors 0-2, buffered as a new
    interpreter's would be."""
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        try:
            tty = os.isatty(fd)
            raw = io.FileIO(fd, "rb" if fd == 0 else "wb", closefd=False)
        except OSError:
            setattr(sys, name, None)
            continue
        buffered = (
            io.BufferedReader(raw) if fd == 0 else io.BufferedWriter(raw)  # type: ignore[arg-type]
        )
        errors = "backslashreplace" if fd == 2 else "strict"
        line = fd == 2 or tty or unbuffered
        stream = io.TextIOWrapper(buffered, errors=errors, line_buffering=line)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_child(child: _Child) -> int:
    """Run ``python -m MODULE ARGS`` in this forked child as a fresh interpreter would; its
    exit status."""
    os.environ.clear()
    os.environ.update(child.env)
    os.chdir(child.cwd)
    _std_streams(child.env)
    extra = [p for p in child.env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [child.cwd, *dict.fromkeys([*extra, *sys.path[1:]])]
    _, module, *args = child.argv
    sys.argv = ["-m", *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # die of SIGINT, as python does
        os.kill(os.getpid(), signal.SIGINT)
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def _serve(socket_path: str, preload: Sequence[str]) -> _Child | None:
    for name in preload:
        __import__(name)
    path = Path(socket_path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(64)
    server = _Server(listener)

    def terminate(*_: object) -> None:
        server.terminated = True  # the loop stops, woken by the wakeup descriptor

    signal.signal(signal.SIGTERM, terminate)
    print(f"{FORK_SERVER_READY} pid={os.getpid()}", flush=True)
    try:
        child = server.run()
    finally:
        if os.getpid() == server.pid:
            path.unlink(missing_ok=True)
    return child


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engines.launch.fork_server", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--socket", required=True, help="path of the Unix socket to listen on")
    parser.add_argument(
        "--preload",
        default="",
        help="comma-separated modules imported once, before any fork",
    )
    args = parser.parse_args(argv)
    child = _serve(args.socket, [m for m in args.preload.split(",") if m])
    if child is None:
        return 0
    return _run_child(child)


# ---- the clients ------------------------------------------------------------------------------


def _request(socket_path: str, message: dict[str, Any], fds: Sequence[int]) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
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
        "executable": argv[0],
        "argv": list(argv[1:]),
        "env": dict(env),
        "cwd": str(cwd),
    }


def _pid_of(socket_path: str, sock: socket.socket) -> int:
    reply = json.loads(sock.recv(_MAX_MESSAGE) or b'{"error": "it closed the connection"}')
    if "pid" not in reply:
        sock.close()
        raise ForkServerError(socket_path, reply.get("error", f"unexpected reply {reply}"))
    return int(reply["pid"])


def list_children(socket_path: str, env_name: str) -> list[tuple[int, str | None]]:
    """The fork server's live children: each pid with the value of ``env_name`` it was given."""
    with _request(socket_path, {"kind": "list", "env": env_name}, []) as sock:
        reply = json.loads(sock.recv(_MAX_MESSAGE))
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
                data = self._sock.recv(_MAX_MESSAGE, socket.MSG_DONTWAIT)
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


if __name__ == "__main__":
    sys.exit(main())
