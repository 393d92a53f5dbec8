"""The service's training models: each a :class:`~trainer.workers.service_model.ServiceModel`
whose operations run one at a time, in the order the client numbered them (``seq_id``), each
under the service's deadline, in a thread (torch never runs on the trio thread).

Tinker promises that a training client's calls run in the order it submitted them, though
their HTTP requests may arrive in any order (the SDK sends a ``forward_backward``'s chunks
concurrently). A model's runner task waits for ``seq_id`` 1, 2, 3, ... in turn; a request sent
again with a ``seq_id`` already taken (the SDK retries a send whose answer it lost) gets the
first one's future.

An operation past ``serve.request_timeout_s`` fails in the SDK's error shape, naming the
operation and the budget, and the model is then broken: its thread cannot be stopped and may
still change the adapter, so every later operation on it fails at once, saying why.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import attrs
import trio

from trainer.serve._futures import PROTOBUF, Answer, FutureStore, failed
from trainer.workers.service_model import ServiceModel

__all__ = ["ModelState", "Operation"]

log = logging.getLogger(__name__)
#: An awaiting operation bounds itself by ``serve.request_timeout_s`` (a typed error naming
#: where it waited); the queue's own bound is this much later, a backstop.
AWAITS_BACKSTOP_S = 30.0


@attrs.frozen
class Operation:
    """One numbered call on a model: ``run`` blocks (a thread runs it) and returns the
    answer's body; ``name`` is the operation's name (``forward_backward``, ``optim_step``)."""

    name: str
    request_id: str
    run: Callable[[ServiceModel], Any]
    #: The answer's body from ``run``'s result: JSON-able, or protobuf bytes.
    protobuf: bool = False
    #: ``run`` returns an awaitable, awaited on the trio thread (an operation that talks to
    #: an engine, and runs its torch parts in threads itself: a sampler save).
    awaits: bool = False


@attrs.define(eq=False)
class ModelState:
    """One training model of a session, and the queue of its numbered operations."""

    model_id: str
    session_id: str
    base_model: str
    model: ServiceModel
    futures: FutureStore
    timeout_s: float
    _pending: dict[int, Operation] = attrs.Factory(dict)
    #: request id of each seq_id received (a resend gets the same future).
    _taken: dict[int, str] = attrs.Factory(dict)
    _next_seq: int = 1
    _arrived: trio.Event = attrs.Factory(trio.Event)
    #: Why the model serves no more operations (a thread that outlived its deadline).
    broken: str | None = None
    #: Cancels the runner task when the model ends (:meth:`end`).
    _runner: trio.CancelScope = attrs.Factory(trio.CancelScope)
    _running: Operation | None = None

    def submit(
        self,
        seq_id: int,
        name: str,
        run: Callable[[ServiceModel], Any],
        *,
        protobuf: bool = False,
        awaits: bool = False,
    ) -> str:
        """Queue operation number ``seq_id``; its request id (the earlier one for a resend)."""
        if seq_id in self._taken:
            return self._taken[seq_id]
        request_id = self.futures.new()
        self._taken[seq_id] = request_id
        if seq_id < self._next_seq:  # numbered before what already ran: it can never run
            self.futures.resolve(
                request_id,
                _json(failed(f"{name} seq_id {seq_id} comes after seq_id {self._next_seq - 1}")),
            )
            return request_id
        self._pending[seq_id] = Operation(name, request_id, run, protobuf, awaits)
        self._arrived.set()
        return request_id

    async def run_operations(self) -> None:
        """Run the operations in ``seq_id`` order until :meth:`end` (the service's nursery owns
        it)."""
        with self._runner:
            while True:
                while self._next_seq not in self._pending:
                    await self._arrived.wait()
                    self._arrived = trio.Event()
                op = self._pending.pop(self._next_seq)
                self._next_seq += 1
                self._running = op
                self.futures.resolve(op.request_id, await self._run(op))
                self._running = None

    def end(self, reason: str) -> None:
        """Serve nothing more: the runner stops (an operation's thread, if one runs, is
        abandoned and ends on its own), every queued operation fails with ``reason``."""
        self.broken = reason
        self._runner.cancel()
        for op in [*self._pending.values(), *([self._running] if self._running else [])]:
            self.futures.resolve(op.request_id, _json(failed(reason, category="server")))
        self._pending.clear()

    async def _run(self, op: Operation) -> Answer:
        if self.broken is not None:
            return _json(failed(self.broken, category="server"))
        result: Any = None
        backstop = AWAITS_BACKSTOP_S if op.awaits else 0.0
        with trio.move_on_after(self.timeout_s + backstop) as scope:
            try:
                if op.awaits:
                    result = await op.run(self.model)
                else:
                    result = await trio.to_thread.run_sync(
                        op.run, self.model, abandon_on_cancel=True
                    )
            except ValueError as exc:  # the request was wrong: the client's error
                return _json(failed(f"{op.name}: {exc}"))
            except Exception as exc:
                log.exception("%s on model %s failed", op.name, self.model_id)
                return _json(failed(f"{op.name}: {type(exc).__name__}: {exc}", category="server"))
        if scope.cancelled_caught:
            self.broken = (
                f"model {self.model_id} is broken: its {op.name} did not finish within "
                f"serve.request_timeout_s={self.timeout_s:g}s and its thread may still change "
                "the adapter; create a new model"
            )
            return _json(
                failed(
                    f"{op.name} did not finish within serve.request_timeout_s="
                    f"{self.timeout_s:g}s (model {self.model_id})",
                    category="server",
                )
            )
        if op.protobuf:
            return Answer(result, PROTOBUF)
        return _json(result)


def _json(payload: object) -> Answer:
    return Answer(json.dumps(payload).encode())
