"""Which of a client's engines take requests, and what a failed one does to those in flight.

Engine ``i`` (a fixed index; its URL changes when it is restarted) is in one of three states:

- ``live``: a member (control calls reach it) and in rotation (requests go to it);
- ``joining``: a member, not in rotation: its server is up again and a weight sync is
  bringing it to the current weights;
- ``down``: neither: it failed and is being restarted.

A request runs in a cancel scope the rotation holds for its engine: taking the engine out
cancels it, and the client sends it again (:meth:`engines.client.InferenceClient.generate_n`).
Without a failure handler (``on_failure`` None, the default) nothing is ever taken out and a
failed request raises, as it always did.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Literal

import trio

from trainer.errors import InferenceServerError

__all__ = ["EngineState", "Rotation", "is_engine_failure"]

EngineState = Literal["live", "joining", "down"]


def is_engine_failure(exc: InferenceServerError) -> bool:
    """Whether a request's error is the engine's failure rather than the request's: no
    answer (connection refused or reset, after the client's retries) or a 5xx."""
    return exc.status is None or exc.status >= 500


class Rotation:
    """The engines of one client: their URLs and states (see the module docstring)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.states: list[EngineState] = ["live"] * len(self.urls)
        #: Called as ``on_failure(index, cause)`` once when a request finds engine ``index``
        #: failed (it is already out of rotation then); None: failures raise.
        self.on_failure: Callable[[int, str], None] | None = None
        #: Counts the changes of the members (an engine left or joined, even at the same URL).
        self.changes = 0
        self._in_flight: list[set[trio.CancelScope]] = [set() for _ in self.urls]
        self._changed = trio.Event()
        self._round_robin = itertools.count()

    @property
    def members(self) -> list[str]:
        """The URLs control calls reach: live and joining engines, in index order."""
        return [u for u, s in zip(self.urls, self.states) if s != "down"]

    def index_of(self, url: str) -> int:
        """The index of the engine at ``url`` (``ValueError`` for no such engine)."""
        return self.urls.index(url.rstrip("/"))

    def pick(self, trajectory_id: str | None) -> int | None:
        """The engine for a request: the same one for one ``trajectory_id`` while it is live
        (sha256, not ``hash``), round-robin without one; None when none is live."""
        live = [i for i, s in enumerate(self.states) if s == "live"]
        if not live:
            return None
        if trajectory_id is None:
            return live[next(self._round_robin) % len(live)]
        digest = int.from_bytes(hashlib.sha256(str(trajectory_id).encode()).digest()[:8], "big")
        home = digest % len(self.urls)
        return home if self.states[home] == "live" else live[digest % len(live)]

    async def wait_pick(self, trajectory_id: str | None) -> int:
        """:meth:`pick`, waiting while no engine is live (bounded by the caller's scopes)."""
        while (index := self.pick(trajectory_id)) is None:
            await self._changed.wait()
        return index

    @contextmanager
    def request(self, index: int) -> Iterator[trio.CancelScope]:
        """A request on engine ``index`` runs inside: cancelled if the engine is taken out
        (check ``cancelled_caught`` afterwards, and send it again)."""
        with trio.CancelScope() as scope:
            if self.states[index] != "live":
                scope.cancel()
            self._in_flight[index].add(scope)
            try:
                yield scope
            finally:
                self._in_flight[index].discard(scope)

    def failed(self, index: int, cause: str) -> None:
        """A request or a health check found engine ``index`` failed: take it out and tell
        the failure handler (once; an engine already out is left as it is)."""
        if self.states[index] == "down":
            return
        self.take_out(index)
        if self.on_failure is not None:
            self.on_failure(index, cause)

    def take_out(self, index: int) -> None:
        """Engine ``index`` is down: out of rotation and of the members; its requests in
        flight are cancelled (their clients send them again)."""
        self.states[index] = "down"
        self.changes += 1
        for scope in self._in_flight[index]:
            scope.cancel()
        self._notify()

    def join(self, index: int, url: str) -> None:
        """Engine ``index`` is up again at ``url``: a member, not yet in rotation."""
        self.urls[index] = url.rstrip("/")
        self.states[index] = "joining"
        self.changes += 1
        self._notify()

    def put_back(self, index: int) -> None:
        """Engine ``index`` serves the current weights: in rotation again."""
        self.states[index] = "live"
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()
