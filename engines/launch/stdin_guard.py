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
- its first line on stderr (the server's log's first line) names its process id, which is
  its group's (``kill -- -PID`` stops the server and everything it started), and the command;
- it exits with the command's exit status (``128 + N`` for a signal ``N``), so the launcher
  sees the server's own failure during start-up.

It dies with the launcher from its first instruction too: the launchers start it under
:mod:`engines.launch.parent_death`, and the guard then asks for SIGTERM rather than SIGKILL
(only when its starter asked for a death signal: a guard run from a shell is left alone), so
that the launcher's death makes it take its whole group down as end-of-file does, vLLM's own
worker processes included; the command it starts gets SIGKILL when the guard dies, however
the guard dies.

Nothing here is trio: this is a separate, single-purpose process, and a blocking read of
stdin in a thread is exactly what it should do.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from engines.launch import parent_death

__all__ = ["main"]


def _signal_group(sig: signal.Signals) -> None:
    """Send ``sig`` to this process group (this guard handles SIGTERM; SIGKILL ends it too)."""
    try:
        os.killpg(os.getpgid(0), sig)
    except ProcessLookupError:
        pass


def _take_down(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the group, give the command ``grace_s`` seconds, then SIGKILL the group."""
    _signal_group(signal.SIGTERM)
    end = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    _signal_group(signal.SIGKILL)


def _watch_stdin(child: subprocess.Popen[bytes], grace_s: float) -> None:
    """Block until stdin reaches end-of-file, then stop the whole group (a daemon thread)."""
    try:
        while os.read(sys.stdin.fileno(), 4096):
            pass
    except OSError:
        pass
    _take_down(child, grace_s)


class _Terminator:
    """SIGTERM's handler: from the launcher's stop the group got it too; from the launcher's
    death (``PR_SET_PDEATHSIG``) only this guard did. Either way the group is taken down, once,
    in a thread (a handler must not block); one that comes before the command has started
    takes it down as soon as it has."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.child: subprocess.Popen[bytes] | None = None
        self.asked = self.started = False

    def __call__(self, *_: object) -> None:
        self.asked = True
        if self.child is not None and not self.started:
            self.started = True
            threading.Thread(
                target=_take_down, args=(self.child, self.grace_s), daemon=True
            ).start()

    def started_command(self, child: subprocess.Popen[bytes]) -> None:
        self.child = child
        if self.asked:
            self()


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
    # the log's first line: the process to signal (``kill -- -PID`` takes the command along)
    pid_line = f"stdin_guard: pid {os.getpid()}, process group {os.getpgid(0)}"
    print(f"{pid_line}: {shlex.join(command)}", file=sys.stderr, flush=True)
    terminate = _Terminator(args.grace_s)
    # set before the command starts, so that no SIGTERM finds the default action
    signal.signal(signal.SIGINT, lambda *_: None)  # the child got it too: wait for it below
    signal.signal(signal.SIGTERM, terminate)
    if parent_death.armed_signal():  # started to die with its launcher: take the group along
        parent_death.arm(os.getppid(), signal.SIGTERM)
    # the command dies with this guard (forked by its only thread), however the guard dies
    child = subprocess.Popen(parent_death.command(command), stdin=subprocess.DEVNULL)
    terminate.started_command(child)
    threading.Thread(target=_watch_stdin, args=(child, args.grace_s), daemon=True).start()
    code = child.wait()
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
