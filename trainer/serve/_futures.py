"""The Tinker protocol's futures: every training call answers at once with a ``request_id``;
the client polls ``/api/v1/retrieve_future`` until the answer is there.

A poll waits for the answer up to :data:`LONG_POLL_S` (the SDK's own request timeout is 45 s),
then answers ``try_again`` and the SDK polls again. An answer stays retrievable for
``serve.future_ttl_s`` after it was given (a client may poll again after a lost response):
:meth:`FutureStore.expire` forgets older ones, and a poll for one is a 404.
"""

from __future__ import annotations

import uuid

import attrs
import trio

__all__ = ["LONG_POLL_S", "Answer", "FutureStore", "failed"]

#: Seconds one ``retrieve_future`` waits for the answer before ``try_again``.
LONG_POLL_S = 20.0

PROTOBUF = "application/x-protobuf"


@attrs.frozen
class Answer:
    """What ``retrieve_future`` answers once the operation has ended: a JSON body (a result,
    or the SDK's ``RequestFailedResponse``) or a protobuf one."""

    body: bytes
    content_type: str = "application/json"


def failed(message: str, *, category: str = "user") -> dict[str, str]:
    """The SDK's ``RequestFailedResponse``: ``category`` ``user`` (the request was wrong: the
    SDK does not retry) or ``server``."""
    return {"error": message, "category": category}


@attrs.define(eq=False)
class _Future:
    done: trio.Event = attrs.Factory(trio.Event)
    answer: Answer | None = None
    #: ``trio.current_time()`` when answered.
    answered_at: float | None = None


@attrs.define(eq=False)
class FutureStore:
    """The service's futures by request id."""

    _futures: dict[str, _Future] = attrs.Factory(dict)

    def new(self) -> str:
        """A fresh request id, pending."""
        request_id = uuid.uuid4().hex
        self._futures[request_id] = _Future()
        return request_id

    def resolve(self, request_id: str, answer: Answer) -> None:
        future = self._futures.get(request_id)
        if future is None or future.answer is not None:  # expired, or answered once already
            return
        future.answer = answer
        future.answered_at = trio.current_time()
        future.done.set()

    def expire(self, before: float) -> int:
        """Forget the futures answered before ``before`` (trio time); how many."""
        old = [
            rid
            for rid, f in self._futures.items()
            if f.answered_at is not None and f.answered_at < before
        ]
        for rid in old:
            del self._futures[rid]
        return len(old)

    def __len__(self) -> int:
        return len(self._futures)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._futures

    async def wait(self, request_id: str, wait_s: float = LONG_POLL_S) -> Answer | None:
        """The answer of ``request_id`` once there, waiting up to ``wait_s``; None past that
        (the caller answers ``try_again``). ``KeyError`` for an unknown id."""
        future = self._futures[request_id]
        with trio.move_on_after(wait_s):
            await future.done.wait()
        return future.answer
