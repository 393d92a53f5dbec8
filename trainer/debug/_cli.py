"""``python -m trainer debug dump PID|RUN_DIR [--json] [--timeout S]``: look inside a live run.

Asks the running trainer (by process id, or by its run directory's ``debug.json``) for a
snapshot over its debug socket and prints it as a tree: every trio task with its step,
stage, operation, deadline and how long it has waited; every busy thread's stack; each
engine server's state. ``--json`` prints the snapshot itself. The run is not disturbed.

When the trainer does not answer within ``--timeout`` (its event loop is blocked), the
command sends it ``SIGUSR1`` and prints the stacks of all its threads, which the
interpreter writes without the event loop. Exit status: 0 with a dump or the stacks,
1 when neither could be had.

Only this user's files are trusted: a socket that is not a socket of this user in a private
debug folder is never connected to, stacks are read without following a link, and
``SIGUSR1`` goes only to a process of this user; anything else is refused in one line
(:mod:`trainer.debug._private`).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import stat
import sys
import time
from pathlib import Path

from rich.console import Console

from trainer.debug._private import UnsafePathError, check_own_socket, check_private_dir
from trainer.debug._render import tree_of
from trainer.debug._server import DEBUG_FILE, debug_paths, pid_alive, request_dump

__all__ = ["debug_main"]


def _target(arg: str) -> tuple[int, Path, Path]:
    """(pid, socket, stacks file) of ``arg``: a process id or a run directory."""
    if arg.isdigit():
        return (int(arg), *debug_paths(int(arg)))
    info_path = Path(arg) / DEBUG_FILE
    try:
        info = json.loads(info_path.read_text())
    except FileNotFoundError:
        raise SystemExit(
            f"debug: {arg} is not the directory of a running trainer (no {DEBUG_FILE})"
        ) from None
    return int(info["pid"]), Path(info["socket"]), Path(info["stacks"])


def _own_process(pid: int) -> bool:
    """Whether ``pid`` runs as this user (where ``/proc`` says; else assumed)."""
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.getuid()
    except OSError:
        return not Path("/proc/self").exists()


def _size(stacks: Path) -> int:
    """The size of the regular file ``stacks`` (0 where there is none, or it is a link)."""
    try:
        st = os.lstat(stacks)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def _read_from(stacks: Path, offset: int) -> str:
    fd = os.open(stacks, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _stacks_by_signal(pid: int, stacks: Path, wait_s: float = 5.0) -> str | None:
    """Make ``pid`` write its threads' stacks (``SIGUSR1``); their text, or None (also where
    ``pid`` is another user's or ``stacks`` is not in a private folder of this user)."""
    if not hasattr(signal, "SIGUSR1") or not stacks.parent.is_dir() or not _own_process(pid):
        return None
    try:
        check_private_dir(stacks.parent)
    except (UnsafePathError, FileNotFoundError):
        return None
    size = _size(stacks)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + wait_s
    last = -1
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = _size(stacks)
        if now > size and now == last:  # written, and done growing
            return _read_from(stacks, size)
        last = now
    return None


def _dump(args: argparse.Namespace) -> int:
    pid, sock, stacks = _target(args.target)
    if not pid_alive(pid):
        print(f"debug: trainer pid {pid} is not running", file=sys.stderr)
        return 1
    try:
        check_own_socket(sock)
    except UnsafePathError as exc:
        print(f"debug: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError:
        pass  # nothing listens there: said below, by the attempt to connect
    try:
        snapshot = request_dump(sock, args.timeout)
    except (OSError, ValueError) as exc:  # TimeoutError and ConnectionRefusedError are OSErrors
        reason = f"{type(exc).__name__}: {exc}"
    else:
        if args.json:
            print(json.dumps(snapshot, indent=2))
        else:
            console = Console()
            if not console.is_terminal:  # a pipe or a file: whole lines, not the terminal's
                console = Console(width=1000)
            console.print(tree_of(snapshot))
        return 0
    text = _stacks_by_signal(pid, stacks)
    if text is None:
        print(f"debug: no dump from pid {pid} ({reason}), and no stacks either", file=sys.stderr)
        return 1
    headline = (
        f"trainer pid {pid} did not answer its debug socket ({reason}): its event loop is "
        "blocked or stopping. Stacks of all its threads, written by the interpreter:"
    )
    if args.json:
        print(json.dumps({"pid": pid, "error": headline, "faulthandler": text}, indent=2))
    else:
        print(headline)
        print(text)
    return 0


def debug_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer debug", description=__doc__)
    sub = parser.add_subparsers(dest="action", required=True)
    dump = sub.add_parser("dump", help="the live task tree, threads and engines of a run")
    dump.add_argument("target", help="the trainer's process id, or its run directory")
    dump.add_argument("--json", action="store_true", help="print the snapshot as JSON")
    dump.add_argument(
        "--timeout", type=float, default=15.0, help="seconds to wait for the dump (default 15)"
    )
    args = parser.parse_args(argv)
    return _dump(args)
