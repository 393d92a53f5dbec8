"""Sessions that end: a client that stops sending heartbeats has its session ended, its models
stopped and their memory freed, and answered futures are forgotten after a while.

The SDK sends ``session_heartbeat`` every 10 s (``SESSION_HEARTBEAT_PERIOD_SEC``) and warns
its user after 120 s without an answer. A session without one for ``serve.session_timeout_s``
(180 s by default: 18 missed beats, past the SDK's own warning) is ended by
:func:`end_idle_sessions_forever`, which looks every :func:`check_period_s` (a quarter of the
smaller bound, at most 10 s): so a session ends at most ``session_timeout_s`` plus one period
after its last heartbeat, and an answer is forgotten at most ``future_ttl_s`` plus one period
after it was given.

Ending a session ends each of its models (:meth:`~trainer.serve._models.ModelState.end`: its
runner stops, its queued operations fail saying why), drops the service's references to them
and collects garbage in a thread, so the model's weights, adapter, optimizer state and
gradients are freed then, or, when an operation's thread still runs (abandoned past its
deadline), when that thread ends. A later heartbeat of the session is answered 410, which the
SDK takes as "this session has finished" and stops its heartbeat loop.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trainer.serve._app import ServiceApp

__all__ = ["check_period_s", "end_idle", "end_idle_sessions_forever"]

log = logging.getLogger(__name__)

#: The longest wait between two looks for idle sessions and old answers.
MAX_CHECK_PERIOD_S = 10.0
#: How many ended sessions are remembered (a heartbeat of one gets a 410, not a 404).
ENDED_KEPT = 1000


def check_period_s(session_timeout_s: float, future_ttl_s: float) -> float:
    return min(session_timeout_s, future_ttl_s, 4 * MAX_CHECK_PERIOD_S) / 4


def end_idle(app: ServiceApp, now: float) -> list[str]:
    """End the sessions of ``app`` whose last heartbeat is older than the timeout at ``now``
    (trio time), with their models, and models whose session is gone; forget answers older
    than the TTL. The ids of the models ended."""
    timeout = app.spec.session_timeout_s
    for session in [s for s in app.sessions.values() if now - s.last_heartbeat > timeout]:
        del app.sessions[session.session_id]
        app.ended[session.session_id] = (
            f"session {session.session_id} ended: no heartbeat for "
            f"serve.session_timeout_s={timeout:g}s"
        )
        while len(app.ended) > ENDED_KEPT:
            del app.ended[next(iter(app.ended))]
    ended = []
    for model_id, state in list(app.models.items()):
        if state.session_id not in app.sessions:
            reason = app.ended.get(state.session_id, f"session {state.session_id} ended")
            state.end(f"{reason}; model {model_id} was freed")
            del app.models[model_id]
            ended.append(model_id)
            log.info("ended model %s of session %s: no heartbeat", model_id, state.session_id)
    app.futures.expire(now - app.spec.future_ttl_s)
    return ended


async def end_idle_sessions_forever(
    app: ServiceApp, *, collect: Callable[[], object] | None = gc.collect
) -> None:
    """:func:`end_idle` every period, and ``collect`` (garbage, in a thread) after a model
    ended; until cancelled (the service's nursery owns it). ``collect=None``: no collection
    (a test of the timing on a virtual clock, which a thread's real seconds would skew)."""
    period = check_period_s(app.spec.session_timeout_s, app.spec.future_ttl_s)
    while True:
        await trio.sleep(period)
        if end_idle(app, trio.current_time()) and collect is not None:
            await trio.to_thread.run_sync(collect)
