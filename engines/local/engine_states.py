"""The reference engine's control-plane states: paused (``keep``, ``abort``, ``wait``), asleep
(weights, KV cache; levels 1 and 2) and awake again, as vLLM's ``/pause``, ``/resume``,
``/sleep`` and ``/wake_up`` leave its engine. :class:`EngineStates` is the half of
:class:`~engines.local.engine.LocalEngine` that holds them; the scheduler, in the other half,
waits on ``_changed`` and runs each decode step under ``_step_lock``."""

from __future__ import annotations

import torch
import trio

from engines.local.model_weights import zero_parameters
from engines.local.requests import Request
from engines.types import PauseMode

__all__ = ["EngineStates"]


class EngineStates:
    """Pause, sleep and wake-up, over the state :class:`~engines.local.engine.LocalEngine` sets up."""

    _pending: list[Request]
    _active: list[Request]
    #: Set (and replaced) on every state change; the scheduler waits on it when idle.
    _changed: trio.Event
    _step_lock: trio.Lock
    _paused: bool
    #: Requests a ``pause(mode="wait")`` lets finish; None when no drain is running.
    _drain: set[Request] | None
    _drainers: int
    _weights_asleep: bool
    _kv_asleep: bool
    _weights_discarded: bool

    model: torch.nn.Module

    def _drop_kv(self) -> None:
        """Forget every request's KV cache (new weights, or a sleep that discards it)."""
        for req in (*self._active, *self._pending):
            req.kv = None

    @property
    def is_paused(self) -> bool:
        return self._paused

    @property
    def is_sleeping(self) -> bool:
        """True while either the weights or the KV cache sleeps."""
        return self._weights_asleep or self._kv_asleep

    @property
    def sleep_state(self) -> dict[str, bool]:
        """Which halves sleep: ``{"weights": bool, "kv_cache": bool}``."""
        return {"weights": self._weights_asleep, "kv_cache": self._kv_asleep}

    @property
    def num_requests(self) -> int:
        """Requests not finished yet (decoding or queued)."""
        return len(self._pending) + len(self._active)

    @property
    def num_running(self) -> int:
        """Requests admitted to the batch (frozen ones included while paused)."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests queued for admission."""
        return len(self._pending)

    @property
    def _awake(self) -> bool:
        return not (self._weights_asleep or self._kv_asleep)

    def _asleep_detail(self) -> str:
        halves = [k for k, v in self.sleep_state.items() if v]
        return (
            f"the engine is sleeping ({' and '.join(halves)} offloaded); "
            "call /wake_up (no tags, or tags=weights then tags=kv_cache) first"
        )

    def _poke(self) -> None:
        """Wake every waiter on the state (the scheduler, draining pauses)."""
        self._changed.set()
        self._changed = trio.Event()

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Stop decoding and admitting requests until ``resume``.

        ``keep``: in-flight requests freeze and continue after ``resume``; ``abort``: they end
        now with ``finish_reason='abort'`` and their partial tokens (queued ones too);
        ``wait``: the requests in flight when called run to completion first, then the engine
        stays paused (requests arriving meanwhile queue until ``resume``). Returns once no
        decode step is running. Raises ``ValueError`` for an unknown mode. If a ``wait``
        pause is cancelled mid-drain the engine stays paused with what is left frozen; a
        ``wait`` pause on a sleeping engine waits for the wake-up.
        """
        if mode not in ("keep", "abort", "wait"):
            raise ValueError(f"unknown pause mode {mode!r}; expected one of keep, abort, wait")
        if mode == "wait":
            inflight = {*self._active, *self._pending}
            self._drain = (self._drain or set()) | inflight
            self._drainers += 1
            self._paused = True
            self._poke()
            try:
                for req in inflight:
                    await req.done.wait()
            finally:
                self._drainers -= 1
                if not self._drainers:
                    self._drain = None
                self._poke()
            async with self._step_lock:  # the step in flight (if any) finishes first
                return
        self._paused = True
        self._poke()
        async with self._step_lock:  # the step in flight finishes first
            if mode == "abort":
                for req in [*self._active, *self._pending]:
                    req.finish("abort")
                self._active.clear()
                self._pending.clear()

    def resume(self) -> None:
        """Resume decoding and admissions; a no-op when not paused."""
        self._paused = False
        self._poke()

    async def sleep(self, level: int = 1, mode: PauseMode = "abort") -> None:
        """Put the weights and the KV cache to sleep (vLLM ``/sleep``).

        Level 1 keeps the weights in host memory; level 2 discards them (they read as zeros
        until ``load_weights``). In-flight requests are handled as by ``pause(mode)`` (vLLM's
        default: abort); kept ones continue after a full ``wake_up``. The paused flag is
        left as it was. Raises ``ValueError`` for another level or mode.
        """
        if level not in (1, 2):
            raise ValueError(f"unknown sleep level {level!r}; expected 1 or 2")
        was_paused = self._paused
        await self.pause(mode)
        async with self._step_lock:
            self._weights_asleep = True
            self._kv_asleep = True
            self._drop_kv()  # the KV cache is discarded, as vLLM's sleep does
            if level == 2 and not self._weights_discarded:
                await trio.to_thread.run_sync(zero_parameters, self.model)
                self._weights_discarded = True
        self._paused = was_paused
        self._poke()

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Wake the halves named by ``tags`` (``weights``, ``kv_cache``); None or [] wakes both.

        Waking an awake half is a no-op. Raises ``ValueError`` for an unknown tag.
        """
        wanted = set(tags) if tags else {"weights", "kv_cache"}
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; expected weights, kv_cache")
        async with self._step_lock:
            if "weights" in wanted:
                self._weights_asleep = False
            if "kv_cache" in wanted:
                self._kv_asleep = False
        self._poke()
