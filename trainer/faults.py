"""Fault injection: make an operation hang, run slow, wait or fail on chosen steps (DESIGN 4.5).

A user feature ("rehearse your timeouts", see docs/troubleshooting.md) and how the end-to-end
tests create real hangs. The spec is ``faults=OP:ACTION[@STEPS],...`` (config key ``faults``;
env ``TRAINER_FAULTS``)::

    forward_backward:hang@2                  step 2's forward_backward never returns
    broadcast_to_inference_engines:sleep=5@2 step 2's weight transfer blocks for 5 s
    /pause:delay=3@1-4                       /pause waits 3 s (non-blocking) on steps 1..4
    generate:error=engine fell over          every generate raises FaultInjected

- ``OP`` is one of :data:`OPERATIONS` (the operations of DESIGN 4.3).
- ``ACTION`` is ``hang`` (never returns), ``sleep=S`` (a blocking sleep of S seconds where
  the operation runs), ``delay=S`` (a non-blocking wait of S seconds) or ``error=MSG``
  (raises :class:`~trainer.errors.FaultInjected`). ``MSG`` cannot contain ``,``; the last
  ``@`` of an entry starts ``STEPS``.
- ``STEPS`` is ``N`` or ``N-M`` (inclusive); without it the fault fires on every call, with
  it only when the current step is known and in range.

Where faults fire
-----------------
A fault fires *where the operation really runs*, so a hung worker is really hung: the
policy worker's thread or process for ``forward_backward``, the engine server's request
handler for ``/pause``, the transfer thread for ``broadcast_to_inference_engines``. Call
sites put one line right before the real work, inside the ``operation(...)`` that names it::

    faults.fire_sync("forward_backward")   # in a worker thread or worker process
    await faults.fire("/pause")            # in trio code (e.g. the engine server's handler)

``step`` defaults to :func:`trainer.deadline.current_step`, which threads started with
``trio.to_thread.run_sync`` inherit; a worker process or server that does not share the
trainer's context passes ``step=`` explicitly (or fires every-step faults only).

What each action does at each kind of call site:

=========  ===========================================  ==========================================
action     ``fire_sync`` (thread, worker, server)        ``await fire`` (trio task)
=========  ===========================================  ==========================================
hang       blocks the thread forever                    ``trio.sleep_forever()``
sleep=S    ``time.sleep(S)``: the thread is blocked      ``time.sleep(S)`` in a thread the task
                                                         does not abandon: not cancellable for S s
delay=S    ``time.sleep(S)`` (blocks only that thread)   ``trio.sleep(S)``: cancellable
error=MSG  raises ``FaultInjected(op, MSG, step)``       same
=========  ===========================================  ==========================================

``fire_sync`` refuses to block the trio thread (rule 1): a ``hang``/``sleep``/``delay`` that
fires there raises ``RuntimeError`` telling the caller to ``await fire(...)`` instead.

Which faults are active
-----------------------
:func:`install` sets the process-wide faults (the trainer calls it at start with its ``faults``
config value) and exports the spec as ``TRAINER_FAULTS`` so that child processes it starts
(engine servers, Ray workers) fire the same faults. When nothing was installed in a process,
the first firing reads ``TRAINER_FAULTS``. With no fault installed, firing costs one dict lookup.

Test-only: :func:`release_hangs` wakes threads blocked in a ``hang`` (they raise
``FaultInjected`` rather than return, so the abandoned operation does not carry on). Nothing
but test teardown calls it; a hang in a run is released by nothing.
"""

from __future__ import annotations

import difflib
import enum
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping

import attrs
import trio

from trainer.deadline import current_step
from trainer.errors import ConfigError, FaultInjected

__all__ = [
    "ENV_VAR",
    "OPERATIONS",
    "Action",
    "Fault",
    "Faults",
    "active",
    "fire",
    "fire_sync",
    "install",
    "parse_faults",
    "release_hangs",
]

#: Environment variable read when nothing was installed; :func:`install` exports it.
ENV_VAR = "TRAINER_FAULTS"

#: Every operation a fault can target: the operations of DESIGN 4.3, control-plane
#: endpoints by their path.
OPERATIONS: tuple[str, ...] = (
    "generate",
    "env_step",
    "forward",
    "forward_backward",
    "optim_step",
    "offload_to_cpu",
    "backload_to_gpu",
    "broadcast_to_inference_engines",
    "init_process_group",
    "save_checkpoint",
    "/pause",
    "/resume",
    "/sleep",
    "/wake_up",
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)

_ACTIONS_HELP = "hang, sleep=S, delay=S or error=MSG"
_STEPS_RE = re.compile(r"(\d+)(?:-(\d+))?")


class Action(enum.Enum):
    """What a fault does when it fires."""

    HANG = "hang"
    SLEEP = "sleep"
    DELAY = "delay"
    ERROR = "error"


@attrs.frozen
class Fault:
    """One parsed ``OP:ACTION[@STEPS]`` entry."""

    #: The operation it targets, one of :data:`OPERATIONS`.
    op: str = attrs.field(validator=attrs.validators.in_(OPERATIONS))
    #: What it does.
    action: Action
    #: Seconds for ``sleep``/``delay``; ``None`` otherwise.
    seconds: float | None = None
    #: The message for ``error``; ``None`` otherwise.
    message: str | None = None
    #: Inclusive ``(first, last)`` steps; ``None`` fires on every call, step known or not.
    steps: tuple[int, int] | None = None

    def applies_to(self, step: int | None) -> bool:
        """Whether this fault fires at ``step`` (``None``: the step is unknown)."""
        if self.steps is None:
            return True
        return step is not None and self.steps[0] <= step <= self.steps[1]

    def __str__(self) -> str:
        if self.action is Action.ERROR:
            action = f"error={self.message}"
        elif self.seconds is not None:
            action = f"{self.action.value}={self.seconds:g}"
        else:
            action = self.action.value
        if self.steps is None:
            steps = ""
        elif self.steps[0] == self.steps[1]:
            steps = f"@{self.steps[0]}"
        else:
            steps = f"@{self.steps[0]}-{self.steps[1]}"
        return f"{self.op}:{action}{steps}"


@attrs.frozen
class Faults:
    """The faults active in a process, in spec order; empty when none.

    ``Faults.parse("forward_backward:hang@2").match("forward_backward", 2)`` is the fault
    that fires there; the first entry that applies wins.
    """

    #: The parsed entries, in the order they were written.
    faults: tuple[Fault, ...] = ()
    #: Per operation, its entries (every operation present, most with ``()``).
    _by_op: Mapping[str, tuple[Fault, ...]] = attrs.field(
        init=False,
        repr=False,
        eq=False,
        default=attrs.Factory(lambda self: _table_of(self.faults), takes_self=True),
    )

    @classmethod
    def parse(cls, spec: str) -> Faults:
        """Parse ``spec`` (see :func:`parse_faults`)."""
        return cls(parse_faults(spec))

    @property
    def spec(self) -> str:
        """The canonical spec string; ``Faults.parse(f.spec) == f``."""
        return ",".join(str(f) for f in self.faults)

    def match(self, op: str, step: int | None) -> Fault | None:
        """The fault that fires for ``op`` at ``step``, or ``None``."""
        for f in self._by_op.get(op, ()):
            if f.applies_to(step):
                return f
        return None

    def __bool__(self) -> bool:
        return bool(self.faults)

    def __iter__(self) -> Iterator[Fault]:
        return iter(self.faults)

    def __len__(self) -> int:
        return len(self.faults)


def _table_of(faults: tuple[Fault, ...]) -> dict[str, tuple[Fault, ...]]:
    table: dict[str, tuple[Fault, ...]] = dict.fromkeys(OPERATIONS, ())
    for f in faults:
        table[f.op] = (*table[f.op], f)
    return table


def _bad(what: str, entry: str, allowed: str) -> ConfigError:
    return ConfigError(f"faults: {what} in {entry!r}; {allowed}")


def _parse_seconds(entry: str, name: str, value: str | None) -> float:
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds >= 0):
        shown = f"{name}={value}" if value is not None else name
        raise _bad(repr(shown), entry, f"{name} needs seconds >= 0, e.g. {name}=5")
    return seconds


def _parse_entry(entry: str) -> Fault:
    op, colon, rest = entry.partition(":")
    op = op.strip()
    if op not in OPERATIONS:
        close = difflib.get_close_matches(op, OPERATIONS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(
            f"faults: unknown operation {op!r} in {entry!r}; {hint}"
            f"operations: {', '.join(OPERATIONS)}"
        )
    if not colon:
        raise _bad("no action", entry, f"write OP:ACTION[@STEPS], ACTION one of {_ACTIONS_HELP}")
    action_text, at, steps_text = rest.rpartition("@")
    if not at:
        action_text, steps_text = rest, ""
    steps: tuple[int, int] | None = None
    if at:
        m = _STEPS_RE.fullmatch(steps_text.strip())
        first = int(m.group(1)) if m else 0
        last = int(m.group(2)) if m and m.group(2) is not None else first
        if m is None or last < first:
            raise _bad(f"bad steps {steps_text!r}", entry, "STEPS is N or N-M with N <= M")
        steps = (first, last)
    name, eq, value = action_text.strip().partition("=")
    name = name.strip()
    arg = value.strip() if eq else None
    if name == Action.HANG.value:
        if arg is not None:
            raise _bad(f"{action_text.strip()!r}", entry, "hang takes no value")
        return Fault(op, Action.HANG, steps=steps)
    if name in (Action.SLEEP.value, Action.DELAY.value):
        return Fault(op, Action(name), seconds=_parse_seconds(entry, name, arg), steps=steps)
    if name == Action.ERROR.value:
        if not arg:
            raise _bad("'error' without a message", entry, "write error=MSG, e.g. error=boom")
        return Fault(op, Action.ERROR, message=arg, steps=steps)
    raise _bad(
        f"unknown action {action_text.strip()!r}", entry, f"ACTION is one of {_ACTIONS_HELP}"
    )


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """Parse ``"OP:ACTION[@STEPS],..."``; an empty or blank spec is no faults.

    Raises ``ConfigError`` with a one-line message naming the bad entry and what is allowed.
    """
    return tuple(_parse_entry(e.strip()) for e in spec.split(",") if e.strip())


# --- the process-wide faults -------------------------------------------------------------

#: ``None`` until :func:`install` runs or the env var has been read.
_active: Faults | None = None
_table: Mapping[str, tuple[Fault, ...]] | None = None
_lock = threading.Lock()
#: Test-only: set (and replaced) by :func:`release_hangs`.
_release_hangs = threading.Event()


def _set(faults: Faults | None) -> None:
    # Callers hold _lock. Firing reads _table without it: one atomic global read.
    global _active, _table
    _active = faults
    _table = None if faults is None else faults._by_op


def install(spec: str | Faults | None) -> Faults:
    """Make ``spec`` the faults of this process and export it for child processes.

    ``spec`` is parsed first (``ConfigError`` on a bad spec, nothing changed). The canonical
    spec is written to ``os.environ[TRAINER_FAULTS]`` (removed when empty) so processes
    started afterwards fire the same faults. ``None`` forgets what was installed: the next
    firing reads ``TRAINER_FAULTS`` again (the environment is left alone).
    """
    if spec is None:
        with _lock:
            _set(None)
        return active()
    faults = spec if isinstance(spec, Faults) else Faults.parse(spec)
    with _lock:
        _set(faults)
    if faults:
        os.environ[ENV_VAR] = faults.spec
    else:
        os.environ.pop(ENV_VAR, None)
    return faults


def active() -> Faults:
    """The faults of this process: installed, else parsed from ``TRAINER_FAULTS``."""
    if _active is None:
        _load_env()
    assert _active is not None
    return _active


def _load_env() -> Mapping[str, tuple[Fault, ...]]:
    faults = Faults.parse(os.environ.get(ENV_VAR, ""))
    with _lock:
        if _active is None:  # an install() racing with us wins
            _set(faults)
        assert _table is not None
        return _table


def _entries(op: str) -> tuple[Fault, ...]:
    table = _table if _table is not None else _load_env()
    try:
        return table[op]
    except KeyError:
        raise ValueError(f"unknown operation {op!r}; operations: {', '.join(OPERATIONS)}") from None


def _resolve(
    op: str, entries: tuple[Fault, ...], step: int | None
) -> tuple[Fault, int | None] | None:
    if step is None:
        step = current_step()
    for f in entries:
        if f.applies_to(step):
            return f, step
    return None


def fire_sync(op: str, step: int | None = None) -> None:
    """Fire ``op``'s fault, if one applies, in synchronous code (a thread, worker or server).

    ``step`` defaults to :func:`trainer.deadline.current_step`. ``hang`` blocks this thread
    forever, ``sleep``/``delay`` block it for their seconds, ``error`` raises
    ``FaultInjected``. ``ValueError`` for an op not in :data:`OPERATIONS` (a caller's typo);
    ``RuntimeError`` if a blocking action fires on the trio thread (use :func:`fire`);
    ``ConfigError`` if this is the process's first firing and ``TRAINER_FAULTS`` is malformed.
    """
    entries = _entries(op)
    if not entries:
        return
    hit = _resolve(op, entries, step)
    if hit is None:
        return
    fault, step = hit
    if fault.action is Action.ERROR:
        raise FaultInjected(op, fault.message or "", step)
    if trio.lowlevel.in_trio_run():
        raise RuntimeError(
            f"fault {str(fault)!r} would block the trio thread; fire it with "
            f"`await trainer.faults.fire({op!r})` or from the thread where {op} runs"
        )
    if fault.action is Action.HANG:
        _hang_thread(op, step)
    else:
        assert fault.seconds is not None
        time.sleep(fault.seconds)


async def fire(op: str, step: int | None = None) -> None:
    """Fire ``op``'s fault, if one applies, in trio code.

    ``hang`` is ``trio.sleep_forever()`` (the task waits until cancelled, e.g. by its
    deadline); ``delay=S`` is ``trio.sleep(S)``; ``sleep=S`` is a blocking ``time.sleep(S)``
    in a thread this task waits for without abandoning it, so it is not cancellable for those
    S seconds (like a transfer in flight); ``error`` raises ``FaultInjected``. No checkpoint
    when no fault fires.
    """
    entries = _entries(op)
    if not entries:
        return
    hit = _resolve(op, entries, step)
    if hit is None:
        return
    fault, step = hit
    if fault.action is Action.ERROR:
        raise FaultInjected(op, fault.message or "", step)
    if fault.action is Action.HANG:
        await trio.sleep_forever()
    assert fault.seconds is not None
    if fault.action is Action.DELAY:
        await trio.sleep(fault.seconds)
    else:
        await trio.to_thread.run_sync(time.sleep, fault.seconds)


def _hang_thread(op: str, step: int | None) -> None:
    # A real blocking wait, not a poll: only release_hangs() (test teardown) ends it.
    _release_hangs.wait()
    raise FaultInjected(op, "hang released (test teardown)", step)


def release_hangs() -> None:
    """Test-only: wake every thread blocked in a ``hang`` fault so far; they raise ``FaultInjected``.

    Hangs that fire afterwards block again (the event is replaced).
    """
    global _release_hangs
    event, _release_hangs = _release_hangs, threading.Event()
    event.set()
