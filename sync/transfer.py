"""The transfer of a weight sync: the policy's bytes moved into the engines, shielded, bounded,
and sent again once when they broke off after reaching them.

The transfer (DESIGN 3 rule 6) runs where the step does not abandon it: in a shielded scope, so
a cancellation that lands mid-transfer (Ctrl-C, a failing sibling) waits for the transfer to
finish (its collective waits bounded by the remaining budget) and then propagates; if the
transfer failed, the error raised is chained (``__cause__``) to the transfer's error.
Generation is never resumed while the transfer is still writing.

One bound the shield does not stop: the step's deadline plus ``sync.transfer_grace_s``
(issue 16, point 4). A transfer still running then (a thread stuck in a collective whose own
timeout does not fire, a hung peer) is abandoned: its rank-0 call and its threads are given up
on (they run with ``abandon_on_cancel``; inside the shield only this bound can cancel them), the
bracket's cleanups are skipped (:meth:`sync.bracket.Cleanups.skip`), so the engines stay paused
(asleep, when the bracket put them to sleep), since their weights may be partial, and the
deadline's typed error says so in its ``detail``. The run then ends; its teardown stops the
engines and the workers. A cancellation that is not a deadline's (Ctrl-C, a failing sibling
task) bounds it the same way: the transfer gets ``sync.transfer_grace_s`` from the
cancellation, then is abandoned and the cancellation goes on (without a deadline, nothing else
would bound the wait).

A transfer that broke off after its ``/start_weight_update`` reached the engines left them
holding partial weights; :func:`transfer_weights` then sends once more (:func:`_resend`
says what), within the deadline, so that the engines hold one complete version, or skips the
cleanups and raises :class:`~trainer.errors.EngineUnusableError`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn, Protocol, TypeVar

import attrs
import trio

from engines.types import ControlPlaneClient, EngineClient
from sync._attempt import Attempt
from sync.bracket import Cleanups
from sync.transports.base import Rank0, WeightTransport, finish_body, routes_of
from trainer.errors import EngineUnusableError, StepTimeoutError
from trainer.vocabulary import (
    current_deadline,
    fire_fault_sync,
    operation,
    pending_deadline_error,
)

__all__ = [
    "TRANSFER_GRACE_S",
    "abandoned_detail",
    "routes_of",
    "run_transfer",
    "transfer_weights",
]

#: The weight sync logs under one name, its entry module's, whichever part of it speaks.
log = logging.getLogger("sync.weights")
T = TypeVar("T")

OP = "broadcast_to_inference_engines"
#: Default of ``sync.transfer_grace_s``: how long past its deadline a transfer may still run.
TRANSFER_GRACE_S = 10.0
#: Why the bracket's cleanups are skipped.
ABANDONED = "the weight transfer was abandoned"
PARTIAL = "the engines hold partial weights"


def abandoned_detail(grace_s: float) -> str:
    """What the deadline's error says when the transfer was abandoned."""
    return (
        f"the weight transfer was still running {grace_s:g}s past the deadline "
        "(sync.transfer_grace_s) and was abandoned; the engines were left paused, since "
        "their weights may be partial"
    )


class _Abandonable(Protocol):
    #: Set by :func:`run_transfer` when it abandoned the transfer.
    abandoned: bool


class _Rank0DuringTransfer:
    """The worker group as a transfer sees it: every rank-0 call may be given up on.

    Only the transfer's own bound (deadline + grace) can cancel it, since the transfer runs
    shielded; so ``abandon_on_cancel`` here means "abandoned at that bound", never sooner.
    """

    def __init__(self, workers: Rank0) -> None:
        self._workers = workers

    async def run_on_rank0(
        self, fn: Callable[..., T], *args: object, abandon_on_cancel: bool = False
    ) -> T:
        return await self._workers.run_on_rank0(fn, *args, abandon_on_cancel=True)


async def run_transfer(
    transfer: Callable[[], Awaitable[object]],
    *,
    grace_s: float = TRANSFER_GRACE_S,
    outcome: _Abandonable | None = None,
    fire: bool = True,
) -> float:
    """Run ``transfer()`` to completion even if cancelled; return its wall seconds.

    It runs in a shielded scope: a cancellation from outside waits for it, then propagates
    at the next checkpoint. If the transfer failed after a cancellation, the deadline's
    typed error (or the failure itself, for a cancellation that is not a deadline's) is
    raised with the transfer's error as ``__cause__``. The shielded scope's own deadline is
    the step's deadline plus ``grace_s``: a transfer still running then is abandoned and
    the deadline's typed error is raised with :func:`abandoned_detail` (``outcome.abandoned``
    records it for the caller). A cancellation from outside moves that bound to at most
    ``grace_s`` after it (the waiting parent sees the cancellation; the transfer, a child task
    in the shield, does not). ``fire``: whether the ``broadcast_to_inference_engines`` fault
    fires (not on a re-send).
    """
    t0 = time.perf_counter()
    with operation(OP):
        ended = await _run_shielded(transfer, grace_s=grace_s, fire=fire)
        elapsed = time.perf_counter() - t0
        if ended.abandoned:
            if outcome is not None:
                outcome.abandoned = True
            await _raise_abandoned(ended.failure, grace_s)
        await _raise_failure(ended.failure)
        return elapsed


@attrs.frozen
class _Ended:
    """How a shielded transfer ended."""

    #: Its error; None: it finished, or was abandoned while it ran.
    failure: Exception | None
    #: It was still running at its bound and was given up on.
    abandoned: bool


async def _run_shielded(
    transfer: Callable[[], Awaitable[object]], *, grace_s: float, fire: bool
) -> _Ended:
    """Run ``transfer()`` (after the ``broadcast_to_inference_engines`` fault, if ``fire``) as
    a shielded child task until it ends or its bound passes. A cancellation from outside
    shortens the bound to ``grace_s`` from then and is swallowed here (the caller's next
    checkpoint raises it again)."""
    failure: Exception | None = None
    bound = trio.CancelScope(shield=True, deadline=current_deadline() + grace_s)
    finished = trio.Event()

    async def shielded() -> None:
        nonlocal failure
        with bound:
            try:
                # the fault fires where the transfer runs: a thread the step does not abandon
                if fire:
                    await trio.to_thread.run_sync(fire_fault_sync, OP, abandon_on_cancel=True)
                await transfer()
            except Exception as exc:
                failure = exc
        finished.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(shielded)
        try:
            await finished.wait()
        except trio.Cancelled:
            # a cancellation that is not the deadline's (Ctrl-C, a failing sibling) gives
            # the transfer grace_s more, not for ever; the caller raises it again
            bound.deadline = min(bound.deadline, trio.current_time() + grace_s)
            with trio.CancelScope(shield=True):
                await finished.wait()
    return _Ended(failure, bound.cancelled_caught)


async def _raise_abandoned(failure: Exception | None, grace_s: float) -> NoReturn:
    """The deadline's typed error, saying the transfer was abandoned; or, for a cancellation
    that is not a deadline's, a warning and the cancellation itself."""
    typed = pending_deadline_error(failure, OP, abandoned_detail(grace_s))
    if typed is not None:
        raise typed from failure
    log.warning(
        "the weight transfer was still running %gs after the run was cancelled "
        "(sync.transfer_grace_s) and was abandoned; the engines were left paused",
        grace_s,
    )
    await trio.lowlevel.checkpoint_if_cancelled()  # the cancellation, raised again
    raise RuntimeError("weight transfer abandoned without a cancellation")  # unreachable


async def _raise_failure(failure: Exception | None) -> None:
    """After a transfer that ended: a pending cancellation (as the deadline's typed error when
    a deadline fired), chained to ``failure``; else ``failure``; else nothing."""
    try:
        await trio.lowlevel.checkpoint_if_cancelled()
    except trio.Cancelled as cancelled:
        if failure is None:
            raise
        typed = pending_deadline_error(failure, OP)
        if typed is not None:
            raise typed from failure
        raise cancelled from failure
    if failure is not None:
        raise failure


@attrs.frozen
class _Transfer:
    """What every attempt of one weight sync's transfer uses."""

    engine: EngineClient
    workers: Rank0
    transport: WeightTransport
    grace_s: float
    #: The bracket's cleanups, skipped when the engines must be left as they are.
    cleanups: Cleanups
    #: The version the engines serve once it is done (``/finish_weight_update`` names it).
    weight_version: int | None = None


async def transfer_weights(
    engine: EngineClient,
    workers: Rank0,
    transport: WeightTransport,
    cleanups: Cleanups,
    *,
    grace_s: float = TRANSFER_GRACE_S,
    weight_version: int | None = None,
) -> dict[str, float]:
    """Move the policy's weights into the engines, as ``weight_version`` (see
    :func:`~sync.transports.base.finish_body`), sent again once if they broke off there;
    return ``sync/resends``, ``sync/last_weight_sync_seconds`` (the transfer that finished;
    absent when only a finish was sent again) and ``sync/bytes``.

    Raises the transfer's error (the engines are intact: it did not reach them, or was sent
    again, complete), or the step deadline's typed error chained to it, or
    :class:`~trainer.errors.EngineUnusableError` when the engines were left with partial weights
    (a deadline or a cancellation is raised then, with the reason as a note). An abandoned
    transfer, or partial weights, skip ``cleanups``.
    """
    sync = _Transfer(engine, workers, transport, grace_s, cleanups, weight_version)
    first = Attempt(engine, fire=True)
    try:
        seconds = await _send(sync, first)
    except BaseException as failure:
        if first.abandoned or not first.broken:
            raise  # abandoned: left paused; not reached the engines: they are intact
        # a deadline or a cancellation ends the step whatever the re-send does
        ends_the_step = not isinstance(failure, Exception) or isinstance(failure, StepTimeoutError)
        resent = await _resend_once(sync, first)
        if resent.why_not is not None:
            cleanups.skip(PARTIAL)
            unusable = EngineUnusableError(list(engine.urls), resent.why_not)
            if not ends_the_step:
                raise unusable from failure
            failure.add_note(str(unusable))
            raise
        if ends_the_step:
            raise  # engines intact
        log.warning(
            "weight sync: the transfer broke off (%s: %s) and was sent again, complete",
            type(failure).__name__,
            failure,
        )
        return _metrics(transport, resends=1.0, seconds=resent.seconds)
    return _metrics(transport, resends=0.0, seconds=seconds)


def _metrics(
    transport: WeightTransport, *, resends: float, seconds: float | None
) -> dict[str, float]:
    """The transfer's metrics; ``sync/bytes`` where the transport counts what it moved
    (``last_bytes``: the tensors announced, or a LoRA adapter's files)."""
    out = {"sync/resends": resends}
    if seconds is not None:
        out["sync/last_weight_sync_seconds"] = seconds
    moved = getattr(transport, "last_bytes", None)
    if isinstance(moved, int) and moved > 0:
        out["sync/bytes"] = float(moved)
    return out


async def _send(sync: _Transfer, attempt: Attempt) -> float:
    """One attempt, bounded by :func:`run_transfer`; its wall seconds. An abandoned attempt
    skips the bracket's cleanups."""
    try:
        return await run_transfer(
            functools.partial(
                sync.transport.transfer,
                attempt.engine,
                _Rank0DuringTransfer(sync.workers),
                weight_version=sync.weight_version,
            ),
            grace_s=sync.grace_s,
            outcome=attempt,
            fire=attempt.fire,
        )
    except BaseException:
        if attempt.abandoned:
            sync.cleanups.skip(ABANDONED)
        raise


@attrs.frozen
class _Resent:
    """How a re-send ended."""

    #: None once the engines hold one complete version, else why they do not.
    why_not: str | None = None
    #: The wall seconds of the transfer sent again (None: only its finish was sent).
    seconds: float | None = None


async def _resend_once(sync: _Transfer, first: Attempt) -> _Resent:
    """Complete the broken-off transfer (:func:`_resend`), whatever cancels the step, within
    its deadline; any way the re-send itself ends early, the engines hold partial weights."""
    refusal = getattr(sync.transport, "resend_refusal", None)
    if current_deadline() <= trio.current_time():
        return _Resent("no time was left to send the weights again")
    with trio.CancelScope(shield=True, deadline=current_deadline()):
        try:
            return await _resend(sync, first, refusal)
        except BaseException as exc:
            return _Resent(f"sending the weights again failed too ({type(exc).__name__}: {exc})")
    raise AssertionError("unreachable: the re-send returns from inside its scope")


async def _resend(sync: _Transfer, first: Attempt, refusal: object) -> _Resent:
    """The re-send rules (``refusal``: the transport's ``resend_refusal``):

    - every bucket was accepted (it broke off before the finish): the finish alone (naming
      the sync's version);
    - the update is open with buckets missing: refused (real vLLM takes neither a second
      start nor a layer twice in one update); its finish is sent, best effort, so that
      a later complete sync is accepted, and the engines stay paused;
    - the update is not open (its start or an update failed on the engines): the open
      update an earlier, abandoned transfer may have left is closed (a finish, best
      effort: real vLLM refuses a start while one is open), then the whole transfer again.
    """
    engine = sync.engine
    if first.open and first.all_sent:
        body = finish_body(sync.weight_version)
        await routes_of(engine).control("POST", "/finish_weight_update", json=body)
        return _Resent()
    if first.open:
        with contextlib.suppress(Exception):
            await routes_of(engine).control("POST", "/finish_weight_update", json={})
        return _Resent(
            "its update was open with buckets missing, which an engine cannot "
            "take again within one update (real vLLM refuses a second start)"
        )
    if refusal is not None:
        return _Resent(f"the transport cannot send again: {refusal}")
    if isinstance(engine, ControlPlaneClient):  # an update an earlier transfer left open
        with contextlib.suppress(Exception):
            await engine.control("POST", "/finish_weight_update", json={})
    return _Resent(seconds=await _send(sync, Attempt(engine, fire=False)))
