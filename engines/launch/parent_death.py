"""Make a child die with the process that started it, from its first instruction.

::

    python -S -I .../engines/launch/parent_death.py --parent PID [--signal KILL] -- COMMAND ...

This file, run by its path (``-S -I``: it imports nothing but the standard library, so it
starts in milliseconds), asks the kernel to send it ``--signal`` when its parent dies
(Linux's ``PR_SET_PDEATHSIG``), checks that its parent is still ``--parent`` (the parent may
have died before the request: then it exits 1 at once, starting nothing), and ``exec``\\ s
``COMMAND``, which keeps the request: the command dies with its starter however the starter
dies (SIGTERM, SIGKILL, a crash), during its imports too, before it could read anything.
:func:`command` writes that line; :func:`arm` is the same request for a process that sets it
on itself (a fork server's children).

Corner cases, all Linux's:

- "its parent" is the *thread* that forked it: the child gets the signal when that thread
  exits, even while the process lives on. A trio program must not start such a child from
  ``trio.to_thread`` (trio's idle threads exit after 10 s, and the child with them):
  :func:`engines.launch.open_child` starts every child from one thread that lives as long
  as the process.
- the request is cleared by ``exec`` of a set-user-ID, set-group-ID or file-capability
  program, and by ``fork`` (the child's own children do not inherit it).
- elsewhere (not Linux) :func:`arm` does nothing and says so (False): the stdin pipe the
  launchers hold is then the only tie.

``--signal``: SIGKILL by default, which no handler, ignored signal or hung import can
delay; SIGTERM for a process whose only job is to take down what it started (its handler
must do that: :mod:`engines.launch.stdin_guard`).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

__all__ = ["EXIT_ORPHANED", "arm", "armed_signal", "command", "main"]

#: ``prctl`` options (``<linux/prctl.h>``).
_PR_SET_PDEATHSIG = 1
_PR_GET_PDEATHSIG = 2
#: Exit status of a child whose parent was gone before it could arm.
EXIT_ORPHANED = 1


def _prctl(option: int, arg: int) -> int | None:
    """``prctl(option, arg)``: its result, or None where there is no ``prctl``."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    return int(libc.prctl(option, arg, 0, 0, 0))


def arm(parent: int, sig: int = signal.SIGKILL) -> bool:
    """Ask for ``sig`` when the thread that started this process exits; then make sure the
    parent is still ``parent``: if it is gone already (this process was re-parented), exit
    :data:`EXIT_ORPHANED` at once. False where the kernel has no such request (not Linux)."""
    if _prctl(_PR_SET_PDEATHSIG, int(sig)) is None:
        return False
    if os.getppid() != parent:  # it died before the request: nobody will send the signal
        os._exit(EXIT_ORPHANED)  # a child that must not start at all
    return True


def armed_signal() -> int:
    """The signal this process gets when its parent dies (0: none, or not Linux)."""
    import ctypes

    if not sys.platform.startswith("linux"):
        return 0
    value = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_GET_PDEATHSIG, ctypes.byref(value), 0, 0, 0)
    return value.value


def command(
    argv: Sequence[str], *, parent: int | None = None, sig: int = signal.SIGKILL
) -> list[str]:
    """``argv`` run under this module: it dies with ``parent`` (default: this process) from
    its first instruction. The caller must start it from a thread that lives as long as the
    tie should (module doc)."""
    parent = os.getpid() if parent is None else parent
    name = signal.Signals(sig).name.removeprefix("SIG")
    script = os.path.abspath(__file__)
    return [
        sys.executable,
        "-S",
        "-I",
        script,
        "--parent",
        str(parent),
        "--signal",
        name,
        "--",
        *argv,
    ]


def _parse(argv: Sequence[str]) -> tuple[int, int, list[str]]:
    """``--parent PID [--signal NAME] -- COMMAND...`` (no argparse: this must start fast)."""
    args = list(argv)
    if "--" not in args:
        raise SystemExit("usage: parent_death.py --parent PID [--signal KILL|TERM] -- COMMAND ...")
    split = args.index("--")
    options, rest = args[:split], args[split + 1 :]
    values = dict(zip(options[::2], options[1::2], strict=False))
    if "--parent" not in values or not rest:
        raise SystemExit("parent_death.py: --parent PID and a COMMAND after -- are required")
    sig = signal.Signals[f"SIG{values.get('--signal', 'KILL')}"]
    return int(values["--parent"]), int(sig), rest


def main(argv: Sequence[str] | None = None) -> int:
    parent, sig, rest = _parse(sys.argv[1:] if argv is None else argv)
    arm(parent, sig)
    try:
        os.execvp(rest[0], rest)
    except OSError as exc:
        print(f"parent_death.py: cannot run {rest[0]!r}: {exc}", file=sys.stderr, flush=True)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
