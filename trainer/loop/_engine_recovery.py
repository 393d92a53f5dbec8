"""Engine fault tolerance: a dead or hung engine is restarted, re-synced and put back.

With ``engine.max_restarts > 0`` (the default: 3) and engines over HTTP that the trainer
started as processes (``engine.backend=local`` or ``vllm``, ``placement=process``) or
someone else's (``remote``), each engine is watched:

- **health checks**: every ``engine.health_check_interval_s`` a ``GET /health`` bounded by
  ``engine.health_check_timeout_s`` (past it the engine is hung), the first one
  ``engine.health_check_first_wait_s`` after the engine (re)started; and whether its server
  process has exited;
- **requests**: a generation request that gets no answer (after the client's retries) or a
  5xx marks its engine failed (:class:`engines.client.Rotation`).

A failed engine is taken out of rotation at once; its requests in flight are cancelled and
sent again, to another live engine or, when none is, to it once it is back (the step waits,
within its budget). Then, one engine at a time: its server is killed (the whole process
group, a stopped one too) and started again (``remote``: waited for, within
``engine.startup_timeout_s``); under the weights lock, which the loop holds while it trains
and syncs, so a restart's sync never overlaps a weight sync nor reads a policy mid-update,
it joins the members, the weight transport is built again for the new set of engines, one
complete weight sync reaches every engine and is verified against the policy on each
(``sync.verify``'s check, whatever that key says); only then is it put back in rotation.

Past ``engine.max_restarts`` restarts of one engine, its next failure ends the run with
:class:`~trainer.errors.EngineFailedError` (its index, URL, restarts, cause and log tail).
Every restart is logged with its cause and time, counted in ``engine/restarts`` (the run's
total, in each step's metrics) and listed in ``summary.json``. Backends this does not cover
(``inprocess``, ``vllm_inprocess``, ``placement=ray``) and ``max_restarts=0`` keep the rule
of before: an engine's failure ends the run.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from engines.client import InferenceClient
from engines.launch import EngineProcesses
from sync.transports import WeightTransport
from trainer.config import Config, EngineBackend
from trainer.errors import (
    EngineFailedError,
    EngineStartError,
    InferenceServerError,
    InferenceServerTimeoutError,
)
from trainer.vocabulary import open_owner_nursery, set_engine_signaller

__all__ = ["EngineRecovery", "open_engine_recovery"]

log = logging.getLogger("trainer.run")

#: Seconds between two ``GET /health`` of a ``remote`` engine that is being waited for.
REMOTE_POLL_S = 1.0


class EngineRecovery:
    """Watches the engines of one client and brings failed ones back (module docstring).

    ``run_training`` hands it its ``resync`` before its first sync (:meth:`set_resync`): one
    complete, verified weight sync to every member engine (:meth:`sync_members`, which builds
    the transport for them first), run under :attr:`weights_lock`.
    """

    def __init__(
        self,
        cfg: Config,
        client: InferenceClient,
        processes: EngineProcesses | None,
        transport: WeightTransport,
        workers: Any,
    ) -> None:
        self.engine = cfg.engine
        #: How long a restarted (or, remote, restarted by someone else) engine may take.
        self.startup_timeout_s = cfg.plan.timeouts.engine_startup_s
        self.client = client
        self.rotation = client.rotation
        self.processes = processes
        self.transport = transport
        self.workers = workers
        n = len(self.rotation.urls)
        #: Restarts of each engine so far (by this process: its ``engine.max_restarts`` budget).
        self.restarts = [0] * n
        #: Restarts before this process, by the run this one resumes (:meth:`carry_over`).
        self.earlier_restarts = 0
        #: One entry per failure brought back: engine, cause, the step, and the seconds from
        #: the failure to serving again (None while it is not back).
        self.events: list[dict[str, object]] = []
        #: Held by the loop while it trains and syncs, and by a restart's sync.
        self.weights_lock = trio.Lock()
        self._resync: Callable[[], Awaitable[object]] | None = None
        self._resync_set = trio.Event()
        #: The step the loop is at (named by a restart's sync and its events).
        self.step = 0
        self._up_since = [time.monotonic()] * n
        self._transport_changes = self.rotation.changes
        self._failures_send, self._failures = trio.open_memory_channel[tuple[int, str]](math.inf)

    @property
    def total_restarts(self) -> int:
        """The run's restarts, before a resume included (``engine/restarts``)."""
        return self.earlier_restarts + sum(self.restarts)

    def state_dict(self) -> dict[str, object]:
        """What a checkpoint keeps of the run's restarts, so a resume goes on counting."""
        return {"restarts": self.total_restarts, "events": list(self.events)}

    def carry_over(self, state: dict[str, Any]) -> None:
        """Count on from a checkpoint's :meth:`state_dict` (the run this one resumes). Each
        engine's ``engine.max_restarts`` budget starts afresh: its server is a new process."""
        self.earlier_restarts = int(state.get("restarts", 0))
        self.events[:0] = [dict(e) for e in state.get("events", ())]

    def set_resync(self, resync: Callable[[], Awaitable[object]]) -> None:
        """How a restarted engine is brought to the current weights (see the class docstring)."""
        self._resync = resync
        self._resync_set.set()

    def failed(self, index: int, cause: str) -> None:
        """Engine ``index`` failed (it is out of rotation already): restart it (in turn)."""
        log.warning("engine %d (%s) failed: %s", index, self.rotation.urls[index], cause)
        self._failures_send.send_nowait((index, cause))

    def took_out(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a weight sync, comes of a member engine that no longer
        answers (a call to it that got no answer, the error itself or its cause, as when the
        broken transfer's re-send failed too: ``EngineUnusableError``): then that engine is
        out (taken out now, if it was not already) and the sync may go on without it. A 5xx
        during a sync is not taken for the engine's death, nor a control call that outlived
        ``engine.control_plane_timeout_s`` (the engine answers, late): they end the sync as
        before, typed."""
        seen: set[int] = set()
        cause: BaseException | None = exc
        while cause is not None and id(cause) not in seen:
            seen.add(id(cause))
            if (
                isinstance(cause, InferenceServerError)
                and cause.status is None
                and not isinstance(cause, InferenceServerTimeoutError)
            ):
                try:
                    index = self.rotation.index_of(cause.url)
                except ValueError:
                    return False
                self.rotation.failed(index, f"during a weight sync: {cause}")
                return True
            cause = cause.__cause__ or cause.__context__
        return False

    async def sync_members(
        self, sync: Callable[[], Awaitable[dict[str, float]]]
    ) -> dict[str, float]:
        """One weight sync (``sync``) to the member engines, over a transport built for them.

        An engine that fails during it (:meth:`took_out`) is left out and the sync runs again,
        complete, to the others; with none left it is skipped ({}): each engine that comes
        back gets its own complete sync before it serves.
        """
        while True:
            if not self.client.urls:
                log.warning("weight sync skipped: no engine is up (each gets one when back)")
                return {}
            try:
                await self.refresh_transport()  # an engine may fail here too
                return await sync()
            except Exception as exc:
                if not self.took_out(exc):
                    raise
                log.warning("weight sync: an engine failed during it; syncing the others again")

    async def refresh_transport(self) -> None:
        """Build the weight transport again when the member engines changed since it was
        built (an engine left or joined, at the same URL too: a restarted server knows none
        of it): its group, or its per-engine set-up, must be theirs."""
        changes = self.rotation.changes
        if changes == self._transport_changes:
            return
        await self.transport.close(self.workers)
        await self.transport.init(self.client, self.workers)
        self._transport_changes = changes

    async def run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Watch every engine and restart the failed ones, one at a time, until cancelled;
        ``EngineFailedError`` once one fails past ``engine.max_restarts``."""
        # no timeout of its own: each check is bounded by engine.health_check_timeout_s
        async with httpx.AsyncClient(headers=self.client.headers, timeout=None) as http:
            async with open_owner_nursery() as nursery:
                for index in range(len(self.restarts)):
                    nursery.start_soon(self._watch, http, index)
                task_status.started()
                async for index, cause in self._failures:
                    await self._recover(http, index, cause)

    # -- watching -----------------------------------------------------------------------------

    async def _watch(self, http: httpx.AsyncClient, index: int) -> None:
        interval = self.engine.health_check_interval_s
        while True:
            first = self._up_since[index] + self.engine.health_check_first_wait_s
            await trio.sleep(max(interval, first - time.monotonic()))
            if self.rotation.states[index] != "live":
                continue
            cause = await self._check(http, index)
            if cause is not None and self.rotation.states[index] == "live":
                self.rotation.failed(index, cause)

    async def _check(self, http: httpx.AsyncClient, index: int) -> str | None:
        """Why engine ``index`` has failed, or None when it is healthy."""
        if self.processes is not None:
            code = self.processes[index].process.poll()
            if code is not None:
                return f"its server exited ({_how(code)})"
        timeout_s = self.engine.health_check_timeout_s
        url = self.rotation.urls[index]
        with trio.move_on_after(timeout_s):
            try:
                response = await http.get(f"{url}/health")
            except httpx.HTTPError as exc:
                return f"GET /health failed: {type(exc).__name__}: {exc}"
            if response.status_code != 200:
                return f"GET /health answered {response.status_code}"
            return None
        return f"GET /health did not answer within {timeout_s:g}s (engine.health_check_timeout_s): hung"

    # -- bringing one back --------------------------------------------------------------------

    async def _recover(self, http: httpx.AsyncClient, index: int, cause: str) -> None:
        started = time.monotonic()
        event: dict[str, object] = {"engine": index, "cause": cause, "step": self.step}
        event["seconds"] = None  # until it serves again
        self.events.append(event)
        log_tail = ""
        while True:
            if self.restarts[index] >= self.engine.max_restarts:
                raise EngineFailedError(
                    index,
                    self.rotation.urls[index],
                    self.restarts[index],
                    self.engine.max_restarts,
                    cause,
                    log_tail or await self._log_tail(index),
                )
            self.restarts[index] += 1
            log.warning(
                "engine %d: restart %d of %d (engine.max_restarts)",
                index,
                self.restarts[index],
                self.engine.max_restarts,
            )
            try:
                url = await self._bring_back(http, index)
                break
            except EngineStartError as exc:
                cause = f"{cause}; then its restart failed: {exc.reason}"
                log_tail = exc.log_tail
        await self._resync_set.wait()  # the run is still starting: its loop can sync soon
        assert self._resync is not None
        async with self.weights_lock:
            self.rotation.join(index, url)
            await self._resync()  # its sync_members builds the transport for the new members
            if self.rotation.states[index] != "joining":
                return  # it failed again during its own sync: that failure is queued next
            self.rotation.put_back(index)
        self._up_since[index] = time.monotonic()
        seconds = time.monotonic() - started
        event |= {"cause": cause, "seconds": round(seconds, 3)}
        log.warning(
            "engine %d back at %s, synced and verified, %.1fs after it failed (restart %d)",
            index,
            url,
            seconds,
            self.restarts[index],
        )

    async def _bring_back(self, http: httpx.AsyncClient, index: int) -> str:
        """The engine's server running and healthy again: its URL."""
        if self.processes is not None:
            return (await self.processes.restart(index)).url
        url = self.rotation.urls[index]  # remote: someone else restarts it; wait for it
        bound = self.startup_timeout_s
        with trio.move_on_after(bound):
            while True:
                try:
                    if (await http.get(f"{url}/health")).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
                await trio.sleep(REMOTE_POLL_S)
        raise EngineStartError(
            url, f"not healthy again within {bound:g}s (engine.startup_timeout_s)"
        )

    async def _log_tail(self, index: int) -> str:
        return await self.processes[index].log_tail() if self.processes is not None else ""


def _how(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit code {code}"


@asynccontextmanager
async def open_engine_recovery(
    cfg: Config,
    client: Any,
    processes: EngineProcesses | None,
    transport: WeightTransport,
    workers: Any,
) -> AsyncIterator[EngineRecovery | None]:
    """Watch the engines while the block runs (None where recovery does not apply: see the
    module docstring). The ``kill_engine``/``stop_engine`` faults reach ``processes``
    whatever ``engine.max_restarts`` says. An ``EngineFailedError`` cancels the block."""
    if processes is not None:
        set_engine_signaller(processes.signal)
    try:
        if cfg.engine.max_restarts == 0 or not isinstance(client, InferenceClient):
            yield None
            return
        if processes is None and cfg.plan.engine_backend is not EngineBackend.REMOTE:
            yield None  # placed by Ray: its actors own the servers
            return
        recovery = EngineRecovery(cfg, client, processes, transport, workers)
        client.rotation.on_failure = recovery.failed
        try:
            async with open_owner_nursery() as nursery:
                await nursery.start(recovery.run)
                yield recovery
                nursery.cancel_scope.cancel()
        finally:
            client.rotation.on_failure = None
    finally:
        set_engine_signaller(None)
