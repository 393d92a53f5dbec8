"""The engine bracket of a weight sync: which one a run uses, and its calls around the transfer.

:meth:`Bracket.of` is the one place that reads ``engine.colocated``,
``engine.offload_kv_for_weight_sync`` and whether rollouts go on during the weight sync
(``trainer.strategy=fully_async``); the weight sync itself
(:func:`sync.weights.sync_weights`), the config's check of which control routes a
run calls, and the engine servers' sleep mode all read the answer.

:func:`open_bracket` makes the calls, one context manager per kind; the transfer is its body:

- :attr:`Bracket.PAUSE`: pause generation (``engine.pause_mode``) -> transfer -> reset the
  prefix cache (``/reset_prefix_cache?reset_running_requests=true``: vLLM drops the prefixes
  computed with the old weights and recomputes the requests kept by the pause) -> resume, the
  resume in a cleanup bracket (the sleeping brackets need no reset: vLLM clears its caches
  when it sleeps);
- :attr:`Bracket.COLOCATED`: wake weights -> transfer -> wake kv_cache, the KV wake in a
  cleanup bracket;
- :attr:`Bracket.OFFLOAD_KV`: sleep -> wake weights -> transfer, the KV wake in a cleanup
  bracket;
- :attr:`Bracket.PAUSE_OFFLOAD_KV`: pause -> sleep -> wake weights -> transfer -> wake
  kv_cache -> resume, the KV wake its own cleanup bracket *inside* the resume bracket, so a
  failed or cancelled transfer still wakes the KV cache before generation resumes.

Cleanups run as DESIGN 3 rule 7 says (what is left of the step's budget; skipped with a note
once it has passed), and not at all once the transfer has called them off
(:meth:`Cleanups.skip`: it was abandoned, or left the engines holding partial weights).
"""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import attrs

from engines.types import EngineClient, PauseMode
from trainer.vocabulary import cleanup_bracket

__all__ = ["Bracket", "Cleanups", "open_bracket"]

#: The weight sync logs under one name, its entry module's, whichever part of it speaks.
log = logging.getLogger("sync.weights")


class Bracket(enum.Enum):
    """The calls around a transfer, in order (the last ones in cleanup brackets)."""

    #: pause -> transfer -> ``/reset_prefix_cache`` -> resume (the engines keep their memory).
    PAUSE = "pause"
    #: wake weights -> transfer -> wake kv_cache (``engine.colocated``: the engines sleep while
    #: the policy trains).
    COLOCATED = "colocated"
    #: sleep -> wake weights -> transfer -> wake kv_cache (``engine.offload_kv_for_weight_sync``).
    OFFLOAD_KV = "offload_kv"
    #: pause -> sleep -> wake weights -> transfer -> wake kv_cache -> resume (the same with
    #: rollouts that go on around the sync: fully-async).
    PAUSE_OFFLOAD_KV = "pause_offload_kv"

    @classmethod
    def of(cls, *, colocated: bool, offload_kv: bool, rollouts_continue: bool) -> Bracket:
        """The bracket of a run: colocated engines sleep whatever else is set."""
        if colocated:
            return cls.COLOCATED
        if offload_kv:
            return cls.PAUSE_OFFLOAD_KV if rollouts_continue else cls.OFFLOAD_KV
        return cls.PAUSE

    @property
    def sleeps(self) -> bool:
        """Whether the engines sleep (``/sleep``, ``/wake_up``; servers need sleep mode)."""
        return self is not Bracket.PAUSE

    @property
    def pauses(self) -> bool:
        """Whether generation is paused and resumed (``/pause``, ``/resume``)."""
        return self in (Bracket.PAUSE, Bracket.PAUSE_OFFLOAD_KV)

    @property
    def resets_prefix_cache(self) -> bool:
        """Whether ``/reset_prefix_cache`` drops the old weights' prefixes (a sleep clears them)."""
        return self is Bracket.PAUSE


@attrs.define(eq=False)
class Cleanups:
    """Whether a bracket's cleanups may still touch the engines (resume them, wake their KV cache).

    The transfer calls them off when resuming or waking the engines would serve partial weights.
    """

    #: Why the cleanups are skipped (logged as ``"/resume skipped: <why>"``); None: they run.
    skipped_because: str | None = None

    def skip(self, why: str) -> None:
        """Skip every cleanup of this bracket from now on; the first reason given is kept."""
        if self.skipped_because is None:
            self.skipped_because = why


@asynccontextmanager
async def open_bracket(
    kind: Bracket, engine: EngineClient, pause_mode: PauseMode = "keep"
) -> AsyncIterator[Cleanups]:
    """``async with open_bracket(kind, engine) as cleanups:`` the transfer, inside ``kind``'s calls.

    The calls before the body run before it; the calls after it run after it succeeded (the
    prefix-cache reset) or whatever happened to it (cleanups, unless ``cleanups`` was told to
    skip them). The body's error propagates unchanged; a cleanup never replaces it.
    """
    cleanups = Cleanups()
    async with _KINDS[kind](engine, pause_mode, cleanups):
        yield cleanups


@asynccontextmanager
async def _pause(
    engine: EngineClient, pause_mode: PauseMode, cleanups: Cleanups
) -> AsyncIterator[None]:
    """pause -> body -> ``/reset_prefix_cache`` (after a body that finished) -> resume."""
    async with _paused(engine, pause_mode, cleanups):
        yield
        # a sleep cleared the caches in the other brackets; here, prefixes (and kept requests)
        # computed with the old weights are dropped before generation resumes
        await engine.reset_prefix_cache(reset_running_requests=True)


@asynccontextmanager
async def _colocated(
    engine: EngineClient, pause_mode: PauseMode, cleanups: Cleanups
) -> AsyncIterator[None]:
    """wake weights -> body -> wake kv_cache (a cleanup)."""
    await engine.wake_up(["weights"])
    async with _cleanup(cleanups, functools.partial(_wake_kv_cache, engine), "/wake_up"):
        yield


@asynccontextmanager
async def _offload_kv(
    engine: EngineClient, pause_mode: PauseMode, cleanups: Cleanups
) -> AsyncIterator[None]:
    """sleep -> wake weights -> body -> wake kv_cache (a cleanup): a sleep, then colocated's."""
    await engine.sleep(1)
    async with _colocated(engine, pause_mode, cleanups):
        yield


@asynccontextmanager
async def _pause_offload_kv(
    engine: EngineClient, pause_mode: PauseMode, cleanups: Cleanups
) -> AsyncIterator[None]:
    """pause -> offload-KV's calls around the body -> resume: the KV wake runs before the resume."""
    async with _paused(engine, pause_mode, cleanups):
        async with _offload_kv(engine, pause_mode, cleanups):
            yield


_KINDS: dict[
    Bracket, Callable[[EngineClient, PauseMode, Cleanups], AbstractAsyncContextManager[None]]
] = {
    Bracket.PAUSE: _pause,
    Bracket.COLOCATED: _colocated,
    Bracket.OFFLOAD_KV: _offload_kv,
    Bracket.PAUSE_OFFLOAD_KV: _pause_offload_kv,
}


@asynccontextmanager
async def _paused(
    engine: EngineClient, pause_mode: PauseMode, cleanups: Cleanups
) -> AsyncIterator[None]:
    """Generation paused around the body, resumed in a cleanup bracket."""
    await engine.pause(pause_mode)
    async with _cleanup(cleanups, engine.resume, "/resume"):
        yield


def _cleanup(
    cleanups: Cleanups, cleanup: Callable[[], Awaitable[object]], label: str
) -> AbstractAsyncContextManager[None]:
    """``cleanup`` after the body, as :func:`~trainer.vocabulary.cleanup_bracket` runs it."""
    return cleanup_bracket(functools.partial(_unless_skipped, cleanups, cleanup, label), label)


async def _unless_skipped(
    cleanups: Cleanups, cleanup: Callable[[], Awaitable[object]], label: str
) -> None:
    if cleanups.skipped_because is not None:
        log.warning("%s skipped: %s", label, cleanups.skipped_because)
        return
    await cleanup()


async def _wake_kv_cache(engine: EngineClient) -> None:
    await engine.wake_up(["kv_cache"])
