"""One attempt of a weight sync's transfer: how far it got on the engines, and the engine as
the transport sees it during the attempt (every call passed through, the control calls
counted)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import TypeVar

from engines.types import (
    Completion,
    ControlPlaneClient,
    EngineClient,
    JSONValue,
    PauseMode,
    QueryParams,
    SamplingParams,
)
from trainer.vocabulary import Operation, fire_fault, operation

__all__ = ["AFTER_FIRST_BUCKET", "BEFORE_FINISH", "Attempt"]

T = TypeVar("T")

#: The trainer-side fault points inside a transfer (once per sync, never in its re-send).
AFTER_FIRST_BUCKET: Operation = "transfer_after_first_bucket"
BEFORE_FINISH: Operation = "transfer_before_finish"


class Attempt:
    """The engines as one transfer attempt sees them: whether it reached them, how far it got,
    whether it was abandoned, and the two trainer-side fault points inside it (``fire``: first
    attempt only). :attr:`engine` is what the transport is handed."""

    def __init__(self, engine: EngineClient, *, fire: bool) -> None:
        self.fire = fire
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
        #: :func:`sync.transfer.run_transfer` gave up on it at its bound.
        self.abandoned = False
        #: The engine the transport drives: one that takes control routes is observed (its
        #: ``control`` calls move the fields above); another one (it loads weights directly,
        #: no route reaches it) is handed over as it is.
        self.engine: EngineClient = (
            _Observed(engine, self) if isinstance(engine, ControlPlaneClient) else engine
        )

    @property
    def broken(self) -> bool:
        return self.started and not self.finished

    async def observe(self, path: str, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``, the control call ``path``, recorded."""
        if path == "/start_weight_update":
            self.started = True
        elif path == "/finish_weight_update":
            self.all_sent = self.open
            await self._point(BEFORE_FINISH)
        try:
            answer = await call()
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
        if self.fire:
            with operation(op):
                await fire_fault(op)


class _Observed:
    """``engine`` with its ``control`` calls recorded by ``attempt``; every other call passes
    through unchanged."""

    def __init__(self, engine: ControlPlaneClient, attempt: Attempt) -> None:
        self._engine = engine
        self._attempt = attempt

    async def control(
        self, method: str, path: str, params: QueryParams | None = None, json: object = None
    ) -> list[JSONValue]:
        return await self._attempt.observe(
            path, lambda: self._engine.control(method, path, params, json)
        )

    async def control_one(
        self,
        url: str,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> JSONValue:
        return await self._engine.control_one(url, method, path, params, json)

    async def get_world_size(self) -> list[int]:
        return await self._engine.get_world_size()

    @property
    def urls(self) -> Sequence[str]:
        return self._engine.urls

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        return await self._engine.generate(prompt_ids, sampling, trajectory_id=trajectory_id)

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        return await self._engine.generate_n(prompt_ids, sampling, n, trajectory_id=trajectory_id)

    async def pause(self, mode: PauseMode = "keep") -> None:
        await self._engine.pause(mode)

    async def resume(self) -> None:
        await self._engine.resume()

    async def sleep(self, level: int = 1, mode: PauseMode | None = None) -> None:
        await self._engine.sleep(level, mode)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        await self._engine.wake_up(tags)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        await self._engine.reset_prefix_cache(reset_running_requests)

    async def max_model_len(self) -> int | None:
        return await self._engine.max_model_len()
