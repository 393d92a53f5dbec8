"""The run's debug socket: a dump for whoever asks, and thread stacks when the loop cannot answer.

A running trainer listens on a unix socket only its user can open,
``$TMPDIR/trainer-debug-UID/PID.sock``, and writes ``RUN_DIR/debug.json`` (``{"pid", "socket",
"stacks"}``) so the run can be found from its directory. A client sends ``dump\\n`` and reads
the snapshot as JSON until the server closes the connection (:func:`request_dump`). The
listening task sleeps in ``accept`` between requests: a run nobody asks costs nothing.

The socket is served from the trio thread, so a loop blocked by a call that never yields
(a bug: DESIGN 3.1) cannot answer. For that case ``SIGUSR1`` makes the interpreter itself
(``faulthandler``, in C, no trio needed) write every thread's stack to ``PID.stacks`` beside
the socket; ``python -m trainer debug dump`` falls back to it.

The folder ``trainer-debug-UID`` sits in a directory every user may write to, so it is made
with mode 0700 or, if it is there already, used only when it is a real folder of this user
that no one else may write to (:func:`~trainer.debug._private.private_dir`); the stacks file
is opened without following a link. A folder that fails raises
:class:`~trainer.debug._private.UnsafePathError` (one line naming it) and is left untouched.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import logging
import os
import signal
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import trio

from trainer.debug._private import open_private, private_dir
from trainer.debug._snapshot import Dumper, Snapshot

__all__ = [
    "DEBUG_FILE",
    "debug_folder",
    "debug_paths",
    "request_dump",
    "serve_debug_socket",
    "stack_signal",
]

log = logging.getLogger("trainer.debug")

#: The file in the run directory that says where its debug socket is.
DEBUG_FILE = "debug.json"
#: How long the end of a run waits for its debug files to be removed.
REMOVE_BOUND_S = 5.0
#: A request must arrive within this many seconds of connecting.
_REQUEST_TIMEOUT_S = 10.0


def debug_folder() -> Path:
    """``$TMPDIR/trainer-debug-UID``: this user's debug sockets and stacks files (whether or
    not it exists, and unchecked: see :func:`~trainer.debug._private.private_dir`)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"trainer-debug-{uid}"


def debug_paths(pid: int) -> tuple[Path, Path]:
    """(socket, stacks file) of the trainer with process id ``pid`` (short: a unix socket's
    path must fit in about 100 bytes, which a run directory under pytest's tmp may not)."""
    folder = debug_folder()
    return folder / f"{pid}.sock", folder / f"{pid}.stacks"


@contextmanager
def stack_signal(stacks: Path) -> Iterator[None]:
    """While inside, ``SIGUSR1`` writes every thread's stack to ``stacks`` (``faulthandler``).

    A no-op where there is no ``SIGUSR1``. Where ``SIGUSR1`` has its default action
    (terminate), it is ignored from entry (from the main thread), so on exit a late
    ``debug dump`` cannot kill an ending run. The file is truncated on
    entry; it is removed when the body ends normally (the process it describes is ending:
    nothing is left in ``$TMPDIR`` per run) and kept when the body raises, if stacks were
    asked for (they stay readable beside the error; an empty file is removed). What a killed
    run leaves, the next run's debug socket removes (:func:`remove_stale_debug_files`).

    ``stacks``'s folder is made private or checked (:func:`~trainer.debug._private.private_dir`)
    and the file is opened without following a link (mode 0600): a folder or file another user
    may control raises :class:`~trainer.debug._private.UnsafePathError` on entry, before the
    signal is touched, and nothing there is truncated or written.
    """
    if not hasattr(signal, "SIGUSR1"):
        yield
        return
    private_dir(stacks.parent)
    fd = open_private(stacks, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    failed = True
    # a `debug dump` that comes after the end (its check raced it) must not kill the ending
    # process, and SIGUSR1's default action is to terminate: where it has that default, it is
    # ignored first, so unregistering below puts back "ignore" with no moment of "terminate"
    # between (a handler of the program's own is left as it is)
    if signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL:
        with contextlib.suppress(ValueError):  # ValueError: not the main thread
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    with os.fdopen(fd, "w") as f:
        faulthandler.register(signal.SIGUSR1, file=f, all_threads=True, chain=False)
        try:
            yield
            failed = False
        finally:
            faulthandler.unregister(signal.SIGUSR1)
            if not failed or os.fstat(f.fileno()).st_size == 0:  # kept: stacks beside an error
                stacks.unlink(missing_ok=True)


async def _answer(dumper: Dumper, stream: trio.SocketStream) -> None:
    """One client: read its request, send the snapshot, close. Never raises but Cancelled."""
    try:
        async with stream:
            with trio.move_on_after(_REQUEST_TIMEOUT_S):
                request = await stream.receive_some(64)
                if request.strip() == b"dump":
                    snapshot = await dumper.snapshot()
                    await stream.send_all(json.dumps(snapshot, default=str).encode())
    except (trio.BrokenResourceError, trio.ClosedResourceError, ConnectionError):
        # the client went away first (it timed out, or was interrupted): expected, one line
        log.info("debug socket: the client left before its dump was sent")
    except Exception:  # a snapshot bug: logged whole, never the run's problem
        log.warning("debug socket: a dump request failed", exc_info=True)


async def serve_debug_socket(
    dumper: Dumper, *, task_status: trio.TaskStatus[Path] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve dumps of this process on its debug socket until cancelled.

    ``task_status.started(socket_path)`` once it listens and ``RUN_DIR/debug.json`` is
    written. On cancellation (the run's end) the socket file and ``debug.json`` are removed.
    A debug folder another user may control raises
    :class:`~trainer.debug._private.UnsafePathError` before anything is bound or written.
    Each request is answered in its own task; a failing one is logged, never raised.
    """
    sock_path, stacks_path = debug_paths(os.getpid())
    info_path = dumper.run_dir / DEBUG_FILE
    await trio.to_thread.run_sync(_prepare_socket_dir, sock_path)
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        await sock.bind(str(sock_path))
        await trio.to_thread.run_sync(os.chmod, sock_path, 0o600)
        sock.listen()
        info = {"pid": os.getpid(), "socket": str(sock_path), "stacks": str(stacks_path)}
        await trio.to_thread.run_sync(info_path.write_text, json.dumps(info) + "\n")
        task_status.started(sock_path)
        await trio.serve_listeners(functools.partial(_answer, dumper), [trio.SocketListener(sock)])
    finally:
        sock.close()
        # shielded (this runs as the run is cancelled) and bounded: a disk that does not
        # answer leaves the two files, which the next run with this pid or directory replaces
        with trio.move_on_after(REMOVE_BOUND_S, shield=True):
            await trio.to_thread.run_sync(_remove, sock_path, info_path, abandon_on_cancel=True)


def _prepare_socket_dir(sock_path: Path) -> None:
    """The socket's folder made private or checked (``UnsafePathError``), emptied of our pid's
    old socket and of what dead runs left. Blocking."""
    private_dir(sock_path.parent)
    sock_path.unlink(missing_ok=True)  # a dead process with our pid left it
    remove_stale_debug_files(sock_path.parent)


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_debug_files(folder: Path) -> int:
    """Remove the ``PID.sock`` and ``PID.stacks`` files in ``folder`` whose process is gone (a
    run killed, or one that failed after its stacks were asked for, leaves them); how many.
    Only names are removed (``unlink`` never follows a link). Blocking: call it on a folder
    that passed :func:`~trainer.debug._private.private_dir`."""
    removed = 0
    for path in folder.iterdir():
        pid, _, kind = path.name.partition(".")
        if kind in ("sock", "stacks") and pid.isdigit() and not pid_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def request_dump(sock_path: Path, timeout_s: float) -> Snapshot:
    """Ask the trainer listening on ``sock_path`` for a snapshot (blocking: for the CLI).

    ``FileNotFoundError``/``ConnectionRefusedError`` when nothing listens there,
    ``TimeoutError`` when no full answer came within ``timeout_s``, ``ValueError`` for an
    answer that is not a JSON object.
    """
    deadline = time.monotonic() + timeout_s
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
        client.settimeout(timeout_s)
        client.connect(str(sock_path))
        client.sendall(b"dump\n")
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no dump within {timeout_s:g}s")
            client.settimeout(left)
            chunk = client.recv(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    answer = json.loads(b"".join(chunks) or b"null")
    if not isinstance(answer, dict):
        raise ValueError("the trainer's debug socket closed without a dump")
    # the JSON of the trainer's Dumper.snapshot (the same code at both ends of the socket)
    return cast(Snapshot, answer)
