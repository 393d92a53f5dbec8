"""``save_weights_for_sampler``: push the policy's weights to the inference engines.

The engine bracket around the transfer (``bracket``, a run's
:attr:`~trainer.config.Config.sync_bracket`, decided by :meth:`sync.bracket.Bracket.of`)
depends on where the engines live:

- non-colocated (default): pause generation (``engine.pause_mode``) -> transfer -> reset
  the prefix cache (``/reset_prefix_cache?reset_running_requests=true``: vLLM drops the
  prefixes computed with the old weights and recomputes the requests kept by the pause) ->
  resume, the resume in a cleanup bracket (the sleeping brackets need no reset: vLLM clears
  its caches when it sleeps);
- colocated (``engine.colocated``): wake weights -> transfer -> wake kv_cache, the KV wake
  in a cleanup bracket;
- ``engine.offload_kv_for_weight_sync`` with the synchronous trainer: sleep -> wake
  weights -> transfer, the KV wake in a cleanup bracket;
- the same with the fully-async trainer: pause -> sleep -> wake weights -> transfer ->
  wake kv_cache -> resume, the KV wake its own cleanup bracket *inside* the resume bracket,
  so a failed or cancelled transfer still wakes the KV cache before generation resumes.

Cleanups run as DESIGN 3 rule 7 says (what is left of the step's budget; skipped with a
note once it has passed).

The transfer (DESIGN 3 rule 6) runs where the step does not abandon it: in a shielded
scope, so a cancellation that lands mid-transfer (Ctrl-C, a failing sibling) waits for
the transfer to finish (its collective waits bounded by the remaining budget) and then
propagates; if the transfer failed, the error raised is chained (``__cause__``) to the
transfer's error. Generation is never resumed while the transfer is still writing.

One bound the shield does not stop: the step's deadline plus ``sync.transfer_grace_s``
(issue 16, point 4). A transfer still running then (a thread stuck in a collective whose
own timeout does not fire, a hung peer) is abandoned: its rank-0 call and its threads are
given up on (they run with ``abandon_on_cancel``; inside the shield only this bound can
cancel them), no cleanup runs, so the engines stay paused (asleep, when the bracket put
them to sleep), since their weights may be partial, and the deadline's typed error says
so in its ``detail``. The run then ends; its teardown stops the engines and the workers.
A cancellation that is not a deadline's (Ctrl-C, a failing sibling task) bounds it the same
way: the transfer gets ``sync.transfer_grace_s`` from the cancellation, then is abandoned and
the cancellation goes on (without a deadline, nothing else would bound the wait).

``sync/last_weight_sync_seconds`` is the transfer alone (the bracket is ``timing/sync_weights``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from engines.types import ControlPlaneClient, EngineClient, PauseMode
from sync.bracket import Bracket
from sync.transports.base import Rank0, WeightTransport
from trainer.errors import EngineUnusableError, StepTimeoutError
from trainer.vocabulary import (
    Operation,
    cleanup_bracket,
    current_deadline,
    fire_fault,
    fire_fault_sync,
    operation,
    pending_deadline_error,
)

__all__ = [
    "TRANSFER_GRACE_S",
    "abandoned_detail",
    "run_transfer",
    "save_weights_for_sampler",
]

log = logging.getLogger(__name__)
T = TypeVar("T")

OP = "broadcast_to_inference_engines"
#: The trainer-side fault points inside a transfer (once per sync, never in its re-send).
AFTER_FIRST_BUCKET: Operation = "transfer_after_first_bucket"
BEFORE_FINISH: Operation = "transfer_before_finish"
#: Default of ``sync.transfer_grace_s``: how long past its deadline a transfer may still run.
TRANSFER_GRACE_S = 10.0


def abandoned_detail(grace_s: float) -> str:
    """What the deadline's error says when the transfer was abandoned."""
    return (
        f"the weight transfer was still running {grace_s:g}s past the deadline "
        "(sync.transfer_grace_s) and was abandoned; the engines were left paused, since "
        "their weights may be partial"
    )


class _Rank0DuringTransfer:
    """The worker group as a transfer sees it: every rank-0 call may be given up on.

    Only the transfer's own bound (deadline + grace) can cancel it, since the transfer runs
    shielded; so ``abandon_on_cancel`` here means "abandoned at that bound", never sooner.
    """

    def __init__(self, workers: Rank0) -> None:
        self._workers = workers

    async def run_on_rank0(
        self, fn: Callable[..., T], *args: Any, abandon_on_cancel: bool = False
    ) -> T:
        return await self._workers.run_on_rank0(fn, *args, abandon_on_cancel=True)


class _Outcome:
    """Whether the transfer was abandoned, or left the engines broken (then no cleanup may
    touch them: resuming or waking them would serve partial weights)."""

    abandoned = False
    broken = False


def routes_of(engine: EngineClient) -> ControlPlaneClient:
    """``engine`` as the route-based transports drive it; ``TypeError`` when it takes no control
    routes (a transport paired with an engine it cannot reach: ``validate_cfg`` refuses the
    configurations that would)."""
    if not isinstance(engine, ControlPlaneClient):
        raise TypeError(
            f"{type(engine).__name__} takes no control routes (/start_weight_update, ...): "
            "use sync.transport=inprocess with it"
        )
    return engine


class _EngineDuringTransfer:
    """The engines as one transfer attempt sees them: whether it reached them, how far it got,
    and the two trainer-side fault points inside it (first attempt only)."""

    def __init__(self, engine: EngineClient, *, fire: bool) -> None:
        self._engine = engine
        self._fire = fire
        self._updates = 0
        #: ``/start_weight_update`` was sent: from then on the engines hold partial weights
        #: (real vLLM: its layers are reloaded as they arrive) until a finish succeeds.
        self.started = False
        self.finished = False
        #: The engines accepted the start and no update failed there: the update is open
        #: (real vLLM then refuses a second start, and a layer sent twice).
        self.open = False
        #: Every bucket was accepted: the transfer had reached its finish.
        self.all_sent = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def control(self, method: str, path: str, params: Any = None, json: Any = None) -> Any:
        if path == "/start_weight_update":
            self.started = True
        elif path == "/finish_weight_update":
            self.all_sent = self.open
            await self._point(BEFORE_FINISH)
        try:
            answer = await routes_of(self._engine).control(method, path, params, json)
        except BaseException:
            if path == "/update_weights":
                self.open = False  # what the engines kept of the update is unknown
            raise
        if path == "/start_weight_update":
            self.open = True
        elif path == "/update_weights":
            self._updates += 1
            if self._updates == 1:
                await self._point(AFTER_FIRST_BUCKET)
        elif path == "/finish_weight_update":
            self.finished, self.open = True, False
        return answer

    async def _point(self, op: Operation) -> None:
        if self._fire:
            with operation(op):
                await fire_fault(op)

    @property
    def broken(self) -> bool:
        return self.started and not self.finished


async def run_transfer(
    transfer: Callable[[], Awaitable[object]],
    *,
    grace_s: float = TRANSFER_GRACE_S,
    outcome: _Outcome | None = None,
    fire: bool = True,
) -> float:
    """Run ``transfer()`` to completion even if cancelled; return its wall seconds.

    It runs in a shielded scope: a cancellation from outside waits for it, then propagates
    at the next checkpoint. If the transfer failed after a cancellation, the deadline's
    typed error (or the failure itself, for a cancellation that is not a deadline's) is
    raised with the transfer's error as ``__cause__``. The shielded scope's own deadline is
    the step's deadline plus ``grace_s``: a transfer still running then is abandoned and
    the deadline's typed error is raised with :func:`abandoned_detail` (``outcome`` records
    it for the caller's cleanups). A cancellation from outside moves that bound to at most
    ``grace_s`` after it (the waiting parent sees the cancellation; the transfer, a child task
    in the shield, does not). ``fire``: whether the ``broadcast_to_inference_engines`` fault
    fires (not on a re-send).
    """
    t0 = time.perf_counter()
    failure: BaseException | None = None
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

    with operation(OP):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shielded)
            try:
                await finished.wait()
            except trio.Cancelled:
                # a cancellation that is not the deadline's (Ctrl-C, a failing sibling) gives
                # the transfer grace_s more, not for ever; it is raised again below
                bound.deadline = min(bound.deadline, trio.current_time() + grace_s)
                with trio.CancelScope(shield=True):
                    await finished.wait()
        elapsed = time.perf_counter() - t0
        if bound.cancelled_caught:
            if outcome is not None:
                outcome.abandoned = True
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
        if failure is None:
            await trio.lowlevel.checkpoint_if_cancelled()
            return elapsed
        try:
            await trio.lowlevel.checkpoint_if_cancelled()
        except trio.Cancelled as cancelled:
            typed = pending_deadline_error(failure, OP)
            if typed is not None:
                raise typed from failure
            raise cancelled from failure
        raise failure


async def save_weights_for_sampler(
    engine: EngineClient,
    workers: Rank0,
    transport: WeightTransport,
    *,
    bracket: Bracket = Bracket.PAUSE,
    pause_mode: PauseMode = "keep",
    grace_s: float = TRANSFER_GRACE_S,
) -> dict[str, float]:
    """Transfer the policy's weights inside the engine bracket; return the sync's metrics.

    ``sync/last_weight_sync_seconds`` is the transfer alone. Raises the transfer's error,
    or the step deadline's typed error chained to it; cleanups never replace it. A transfer
    abandoned at the deadline plus ``grace_s`` leaves the engines as the transfer found
    them (paused or asleep): no cleanup runs.
    """
    out: dict[str, float] = {"sync/resends": 0.0}
    outcome = _Outcome()

    attempts: list[_EngineDuringTransfer] = []

    async def attempt(fire: bool) -> None:
        attempts.append(seen := _EngineDuringTransfer(engine, fire=fire))
        out["sync/last_weight_sync_seconds"] = await run_transfer(
            lambda: transport.transfer(seen, _Rank0DuringTransfer(workers)),
            grace_s=grace_s,
            outcome=outcome,
            fire=fire,
        )

    async def transfer_and_record() -> None:
        try:
            await attempt(fire=True)
        except BaseException as failure:
            if outcome.abandoned or not attempts[-1].broken:
                raise  # abandoned: left paused; not reached the engines: they are intact
            # a deadline or a cancellation ends the step whatever the re-send does
            ends_the_step = not isinstance(failure, Exception) or isinstance(
                failure, StepTimeoutError
            )
            why = await resend_once()
            if why is not None:
                outcome.broken = True
                if not ends_the_step:
                    raise EngineUnusableError(list(engine.urls), why) from failure
                failure.add_note(str(EngineUnusableError(list(engine.urls), why)))
                raise
            out["sync/resends"] = 1.0
            if ends_the_step:
                raise  # engines intact
            log.warning(
                "weight sync: the transfer broke off (%s: %s) and was sent again, complete",
                type(failure).__name__,
                failure,
            )

    async def resend_once() -> str | None:
        """Complete the broken-off transfer, whatever cancels the step, within its deadline;
        None once the engines hold one complete version, else why not.

        - every bucket was accepted (it broke off before the finish): the finish alone;
        - the update is open with buckets missing: refused (real vLLM takes neither a second
          start nor a layer twice in one update); its finish is sent, best effort, so that
          a later complete sync is accepted, and the engines stay paused;
        - the update is not open (its start or an update failed on the engines): the open
          update an earlier, abandoned transfer may have left is closed (a finish, best
          effort: real vLLM refuses a start while one is open), then the whole transfer again.
        """
        first = attempts[-1]
        refusal = getattr(transport, "resend_refusal", None)
        if current_deadline() <= trio.current_time():
            return "no time was left to send the weights again"
        with trio.CancelScope(shield=True, deadline=current_deadline()):
            try:
                if first.open and first.all_sent:
                    await routes_of(engine).control("POST", "/finish_weight_update", json={})
                    return None
                if first.open:
                    with contextlib.suppress(Exception):
                        await routes_of(engine).control("POST", "/finish_weight_update", json={})
                    return (
                        "its update was open with buckets missing, which an engine cannot "
                        "take again within one update (real vLLM refuses a second start)"
                    )
                if refusal is not None:
                    return f"the transport cannot send again: {refusal}"
                if isinstance(
                    engine, ControlPlaneClient
                ):  # an update an earlier transfer left open
                    with contextlib.suppress(Exception):
                        await engine.control("POST", "/finish_weight_update", json={})
                await attempt(fire=False)
            except BaseException as exc:  # any way it ends, the engines hold partial weights
                return f"sending the weights again failed too ({type(exc).__name__}: {exc})"
        return None

    def after(cleanup: Callable[[], Awaitable[object]], label: str):
        async def unless_abandoned() -> None:
            if outcome.abandoned:
                log.warning("%s skipped: the weight transfer was abandoned", label)
                return
            if outcome.broken:
                log.warning("%s skipped: the engines hold partial weights", label)
                return
            await cleanup()

        return cleanup_bracket(unless_abandoned, label)

    async def wake_kv() -> None:
        await engine.wake_up(["kv_cache"])

    if bracket is Bracket.COLOCATED:
        await engine.wake_up(["weights"])
        async with after(wake_kv, "/wake_up"):
            await transfer_and_record()
    elif bracket is Bracket.PAUSE_OFFLOAD_KV:
        await engine.pause(pause_mode)
        async with after(engine.resume, "/resume"):
            await engine.sleep(1)
            await engine.wake_up(["weights"])
            async with after(wake_kv, "/wake_up"):
                await transfer_and_record()
    elif bracket is Bracket.OFFLOAD_KV:
        await engine.sleep(1)
        await engine.wake_up(["weights"])
        async with after(wake_kv, "/wake_up"):
            await transfer_and_record()
    else:  # Bracket.PAUSE
        await engine.pause(pause_mode)
        async with after(engine.resume, "/resume"):
            await transfer_and_record()
            # a sleep cleared the caches above; here, prefixes (and kept requests) computed
            # with the old weights are dropped before generation resumes
            await engine.reset_prefix_cache(reset_running_requests=True)
    return out
