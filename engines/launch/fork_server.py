"""A fork server: one process that imported the heavy modules once and forks servers from itself.

::

    python -m engines.launch.fork_server --socket /tmp/fs.sock --preload engines.local.__main__

Starting a reference server (``python -m engines.local serve``) costs about 5 s of CPU before
it does anything: importing torch, transformers and hypercorn. A fork server pays that once;
each server it starts is a ``fork`` of it, running ``python -m MODULE ARGS`` as a fresh
interpreter would (its own session, its own stdin/stdout/stderr, environment and working
directory), in well under a second. The launchers use it for the reference servers of a run
when ``engine.fork_server`` (env ``TRAINER_FORK_SERVER``) names its socket
(:func:`~engines.launch.fork_process`); the test suite runs ``python -m trainer`` through one
(:func:`~engines.launch.fork_popen`).

The protocol: a Unix ``SOCK_SEQPACKET`` socket; one connection per child. The client sends
one JSON message, with the child's stdin, stdout and stderr as three file descriptors
(``SCM_RIGHTS``)::

    {"kind": "spawn", "python": PREFIX, "argv": ["-m", MODULE, *ARGS],
     "env": {...}, "cwd": DIR}

and gets ``{"pid": N}`` once forked (or ``{"error": TEXT}``), then ``{"returncode": R}`` when
the child exits (``-N`` for a signal N, as :mod:`subprocess` says it). ``{"kind": "list",
"env": NAME}`` answers ``{"children": [[pid, value-of-NAME-or-null], ...]}``: the live
children, which ``/proc/PID/environ`` cannot tell apart (a forked child shows its parent's
environment there).

How it differs from a fresh ``python``: modules already imported here are not imported again
(their import-time state, such as a variable read at import, is the fork server's), and the
child's ``sys.path`` is the fork server's plus the child's ``PYTHONPATH``. Only this Python
(``python``: the real path of the client's ``sys.prefix``, its installation or virtual
environment, whatever the path it was started by) is forked; anything else is refused. It ends when its stdin reaches
end-of-file (its owner died or closed it) or on SIGTERM, once its children have exited.

Its children are in sessions of their own and end as their clients decide, but never outlive
them: a child whose client's connection closes before the child exited (the client died,
SIGKILLed or crashed, or dropped it) is SIGKILLed with its process group at once, and every
child gets SIGKILL from the kernel when the fork server itself dies (``PR_SET_PDEATHSIG``,
:mod:`engines.launch.parent_death`, set first thing after the fork). A client that must let
a child run on keeps its connection (the client objects do, until they read its exit).

Only its owner may have it fork: the socket is made 0600, and a connection from a process
of another user (``SO_PEERCRED``) is closed before it is read, since what it forks runs as
the server's user.

Nothing here is trio: the server is a separate, single-purpose process (a selector loop); the
trio client does its one blocking ``sendmsg`` in a thread.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from engines.launch._fork_client import FORK_SERVER_READY, MAX_MESSAGE, python_prefix
from engines.launch.parent_death import arm

__all__ = ["main"]


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
            if _peer_uid(conn) not in (os.getuid(), None):
                conn.close()  # another user's process: it would run code as this one
                return None
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
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
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
        if message.get("python") != python_prefix() or len(fds) != 3:
            reason = f"it forks only the Python of {python_prefix()}, with stdin, stdout and stderr"
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
        arm(self.pid)  # dies with the server (its only thread forked it); gone already: exit
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
        """The client of ``conn`` left while its child runs: SIGKILL the child's process group
        (the child is not reaped yet, so its pid, which is the group's id, is still its own)."""
        for pidfd, (pid, other, env) in self.children.items():
            if other is conn:
                self.children[pidfd] = (pid, None, env)
                for kill in (os.killpg, os.kill):  # the child itself, if not yet in its group
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass  # gone already (or not yet the leader of its group)

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
    # the module runs afresh as ``__main__`` (what it imports stays imported): a preloaded copy
    # would make runpy warn that it was imported before it ran
    for name in (module, f"{module}.__main__"):
        sys.modules.pop(name, None)
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


def _peer_uid(conn: socket.socket) -> int | None:
    """The user id of the process at the other end of ``conn`` (``SO_PEERCRED``; None where
    the platform has no such option)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, option, 12))
    return uid


def _serve(socket_path: str, preload: Sequence[str]) -> _Child | None:
    for name in preload:
        __import__(name)
    path = Path(socket_path)
    path.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    umask = os.umask(0o177)  # the socket is made 0600: connecting takes write permission
    try:
        listener.bind(str(path))
    finally:
        os.umask(umask)
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


if __name__ == "__main__":
    sys.exit(main())
