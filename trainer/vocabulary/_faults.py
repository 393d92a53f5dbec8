"""The faults of this process, and firing them where an operation really runs (DESIGN 4.5).

A user feature ("rehearse your timeouts", docs/troubleshooting.md) and how the end-to-end
tests create real hangs. Call sites put one line right before the real work, inside the
``operation(...)`` that names it::

    fire_fault_sync("forward_backward")   # in a worker thread or worker process
    await fire_fault("/pause")            # in trio code (e.g. the engine server's handler)

``step`` defaults to :func:`current_step`, which threads started with
``trio.to_thread.run_sync`` inherit; a worker process that does not share the trainer's
context enters ``at_step(step)`` or passes ``step=``.

=========  ===========================================  ==========================================
action     ``fire_fault_sync`` (thread, worker, server)  ``await fire_fault`` (trio task)
=========  ===========================================  ==========================================
hang       blocks the thread forever                    ``trio.sleep_forever()``
sleep=S    ``time.sleep(S)``: the thread is blocked      ``time.sleep(S)`` in a thread the task
                                                         does not abandon: not cancellable for S s
delay=S    ``time.sleep(S)`` (blocks only that thread)   ``trio.sleep(S)``: cancellable
error=MSG  raises ``FaultInjected(op, MSG, step)``       same
kill_eng.  (trainer operations only)                    ``SIGKILL`` to engine I's server, once
stop_eng.  (trainer operations only)                    ``SIGSTOP`` to engine I's server, once
=========  ===========================================  ==========================================

The four sampler-skewing actions (``stale``, ``drop_bucket``, ``bf16_logits``, ``skip_load``)
fire neither way: the reference engine asks :func:`sampler_skew` where it does the work and
disagrees as told, silently.

``kill_engine=I`` and ``stop_engine=I`` go through the engine signaller the run registers
(:func:`set_engine_signaller`: it signals engine I's whole process group where it runs),
and fire once per entry: a restarted engine is not killed again by the same entry.

``fire_fault_sync`` refuses to block the trio thread (rule 1): a ``hang``/``sleep``/``delay``
that fires there raises ``RuntimeError`` telling the caller to ``await fire_fault(...)``.

:func:`install_faults` sets the process-wide faults (the trainer calls it at start with its
``faults`` config value) and exports the spec as ``TRAINER_FAULTS`` so that child processes
(engine servers, Ray workers) fire the same faults; with ``fired_log`` it also exports
``TRAINER_FAULTS_FIRED``, a file every process appends each fault that fires to, so the
trainer can say at the end of a run which faults never fired (:func:`unfired_faults`). When
nothing was installed in a process, the first firing reads ``TRAINER_FAULTS``. With no
fault installed, firing costs one dict lookup.

Test-only: :func:`release_hangs` wakes threads blocked in a ``hang`` (they raise
``FaultInjected`` rather than return, so the abandoned operation does not carry on).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import trio

from trainer.errors import FaultInjected
from trainer.vocabulary._context import current_step
from trainer.vocabulary._fault_spec import Action, Fault, Faults

__all__ = [
    "FAULTS_ENV",
    "FAULTS_FIRED_ENV",
    "active_faults",
    "fire_fault",
    "fire_fault_sync",
    "install_faults",
    "release_hangs",
    "sampler_skew",
    "set_engine_signaller",
    "unfired_faults",
]

#: Environment variable read when nothing was installed; :func:`install_faults` exports it.
FAULTS_ENV = "TRAINER_FAULTS"
#: A file each process appends a fault's spec to when it fires (one line each).
FAULTS_FIRED_ENV = "TRAINER_FAULTS_FIRED"

#: ``None`` until :func:`install_faults` runs or the env var has been read.
_active: Faults | None = None
_lock = threading.Lock()
#: Faults that fired in this process (their spec strings).
_fired: set[str] = set()
#: Test-only: set (and replaced) by :func:`release_hangs`.
_release = threading.Event()
#: Sends a signal to engine ``I``'s server: ``signaller(I, signal.SIGKILL)`` (None: no engines).
_engine_signaller: Callable[[int, signal.Signals], None] | None = None


def set_engine_signaller(signaller: Callable[[int, signal.Signals], None] | None) -> None:
    """Register how ``kill_engine``/``stop_engine`` reach an engine's server (None: unset)."""
    global _engine_signaller
    _engine_signaller = signaller


def install_faults(spec: str | Faults | None, *, fired_log: Path | None = None) -> Faults:
    """Make ``spec`` the faults of this process and export it for child processes.

    ``spec`` is parsed first (``ConfigError`` on a bad spec, nothing changed). The canonical
    spec is written to ``os.environ[TRAINER_FAULTS]`` (removed when empty) so processes
    started afterwards fire the same faults; ``fired_log`` (a file, emptied here) goes to
    ``TRAINER_FAULTS_FIRED``. ``None`` forgets what was installed: the next firing reads
    ``TRAINER_FAULTS`` again (the environment is left alone).
    """
    global _active
    if spec is None:
        with _lock:
            _active = None
        return active_faults()
    faults = spec if isinstance(spec, Faults) else Faults.parse(spec)
    with _lock:
        _active = faults
        _fired.clear()
    if faults:
        os.environ[FAULTS_ENV] = faults.spec
    else:
        os.environ.pop(FAULTS_ENV, None)
    if fired_log is not None and faults:
        fired_log.write_text("")
        os.environ[FAULTS_FIRED_ENV] = str(fired_log)
    else:
        os.environ.pop(FAULTS_FIRED_ENV, None)
    return faults


def active_faults() -> Faults:
    """The faults of this process: installed, else parsed from ``TRAINER_FAULTS``."""
    global _active
    faults = _active
    if faults is None:
        parsed = Faults.parse(os.environ.get(FAULTS_ENV, ""))
        with _lock:
            if _active is None:  # an install racing with us wins
                _active = parsed
            faults = _active
    return faults


def unfired_faults() -> list[Fault]:
    """The installed faults that fired nowhere: not here, not in a child that logged it."""
    fired = set(_fired)
    log = os.environ.get(FAULTS_FIRED_ENV)
    if log:
        try:
            fired |= set(Path(log).read_text().splitlines())
        except OSError:
            pass
    return [f for f in active_faults() if str(f) not in fired]


def _firing(op: str, step: int | None) -> tuple[Fault, int | None] | None:
    """The fault that fires for ``op`` now (recorded as fired), or None; raises for ``error``."""
    entries = active_faults().entries(op)
    if not entries:
        return None
    if step is None:
        step = current_step()
    fault = next(
        (
            f
            for f in entries
            if f.applies_to(step)
            and not f.action.skews_sampler  # the engine asks for those: sampler_skew
            and not (f.action.signals_engine and str(f) in _fired)
        ),
        None,
    )
    if fault is None:
        return None
    _record(fault)
    if fault.action is Action.ERROR:
        raise FaultInjected(op, fault.message or "", step)
    return fault, step


def sampler_skew(op: str, step: int | None = None) -> Action | None:
    """The sampler-skewing action (:data:`~trainer.vocabulary.SKEW_OPS`) that applies to ``op``
    at ``step`` (default :func:`current_step`), recorded as fired; None when none does.

    The reference engine asks where it does the work (``/update_weights``,
    ``/finish_weight_update``, each ``generate``, ``/v1/load_lora_adapter``) and carries on, disagreeing as told; the
    call succeeds. :func:`fire_fault` and :func:`fire_fault_sync` never fire these.
    """
    entries = active_faults().entries(op)
    if not entries:
        return None
    if step is None:
        step = current_step()
    fault = next((f for f in entries if f.action.skews_sampler and f.applies_to(step)), None)
    if fault is None:
        return None
    _record(fault)
    return fault.action


def _record(fault: Fault) -> None:
    spec = str(fault)
    if spec in _fired:
        return
    _fired.add(spec)
    log = os.environ.get(FAULTS_FIRED_ENV)
    if log:
        try:  # one short O_APPEND write: lines from several processes do not interleave
            with open(log, "a") as f:
                f.write(spec + "\n")
        except OSError:
            pass


def fire_fault_sync(op: str, step: int | None = None) -> None:
    """Fire ``op``'s fault, if one applies, in synchronous code (a thread, worker or server).

    ``step`` defaults to :func:`current_step`. ``hang`` blocks this thread forever,
    ``sleep``/``delay`` block it for their seconds, ``error`` raises ``FaultInjected``.
    ``ValueError`` for an op not in ``OPERATIONS`` (a caller's typo); ``RuntimeError`` if a
    blocking action fires on the trio thread (use :func:`fire_fault`); ``ConfigError`` if this
    is the process's first firing and ``TRAINER_FAULTS`` is malformed.
    """
    hit = _firing(op, step)
    if hit is None:
        return
    fault, step = hit
    if trio.lowlevel.in_trio_run():
        raise RuntimeError(
            f"fault {str(fault)!r} would block the trio thread; fire it with "
            f"`await fire_fault({op!r})` or from the thread where {op} runs"
        )
    if fault.action is Action.HANG:
        _release.wait()  # a real blocking wait: only release_hangs() (test teardown) ends it
        raise FaultInjected(op, "hang released (test teardown)", step)
    assert fault.seconds is not None
    time.sleep(fault.seconds)


async def fire_fault(op: str, step: int | None = None) -> None:
    """Fire ``op``'s fault, if one applies, in trio code.

    ``hang`` is ``trio.sleep_forever()`` (the task waits until cancelled, e.g. by its
    deadline); ``delay=S`` is ``trio.sleep(S)``; ``sleep=S`` is a blocking ``time.sleep(S)``
    in a thread this task waits for without abandoning it, so it is not cancellable for
    those S seconds (like a transfer in flight); ``error`` raises ``FaultInjected``. No
    checkpoint when no fault fires.
    """
    hit = _firing(op, step)
    if hit is None:
        return
    fault, _ = hit
    if fault.action.signals_engine:
        _signal_engine(fault)
        return
    if fault.action is Action.HANG:
        await trio.sleep_forever()
    assert fault.seconds is not None
    if fault.action is Action.DELAY:
        await trio.sleep(fault.seconds)
    else:
        await trio.to_thread.run_sync(time.sleep, fault.seconds)


def _signal_engine(fault: Fault) -> None:
    assert fault.engine is not None
    if _engine_signaller is None:
        raise RuntimeError(
            f"fault {str(fault)!r} needs engine servers the trainer started as processes "
            "(engine.backend=local or vllm, engine.placement=process)"
        )
    sig = signal.SIGKILL if fault.action is Action.KILL_ENGINE else signal.SIGSTOP
    _engine_signaller(fault.engine, sig)


def release_hangs() -> None:
    """Test-only: wake every thread blocked in a ``hang`` so far; they raise ``FaultInjected``.

    Hangs that fire afterwards block again (the event is replaced).
    """
    global _release
    event, _release = _release, threading.Event()
    event.set()
