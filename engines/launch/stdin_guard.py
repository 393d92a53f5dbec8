"""Run a server that cannot watch its stdin so that it still dies with its launcher.

::

    python -m engines.launch.stdin_guard [--grace-s 10] -- vllm serve MODEL ...

The launchers (:mod:`engines.launch`: child processes, Ray actors) start every server in its
own session with a pipe on its stdin, and rely on the server exiting when that pipe reaches
end-of-file: that is how a server never outlives a trainer that was SIGKILLed. The reference
server does it itself (``--exit-on-stdin-eof``); ``vllm serve`` has no such option, so it
runs under this guard, which is its process group's leader:

- the guard starts the command in its own process group, with stdin closed to it;
- on end-of-file on its stdin, it sends SIGTERM to the whole group, waits up to
  ``--grace-s`` seconds for the command, then sends SIGKILL to the group (itself included);
- on SIGTERM or SIGINT (the launcher stopping the group), it waits for the command, which
  got the same signal, and the launcher escalates to SIGKILL if it has to;
- it exits with the command's exit status (``128 + N`` for a signal ``N``), so the launcher
  sees the server's own failure during start-up.

Nothing here is trio: this is a separate, single-purpose process, and a blocking read of
stdin in a thread is exactly what it should do.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

__all__ = ["main"]


def _signal_group(sig: signal.Signals) -> None:
    """Send ``sig`` to this process group (this guard ignores SIGTERM; SIGKILL ends it too)."""
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def _watch_stdin(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """Block until stdin reaches end-of-file, then stop the whole group (a daemon thread)."""
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    _signal_group(signal.SIGTERM)
    end = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    _signal_group(signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engines.launch.stdin_guard", description=__doc__
    )
    parser.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM to SIGKILL, seconds")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (write it after --)")
    if os.getpgid(0) != os.getpid():
        os.setpgid(0, 0)  # be the leader of the group the watcher signals
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)  # the child got it too: wait for it below
    threading.Thread(target=_watch_stdin, args=(child, args.grace_s), daemon=True).start()
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
