"""vLLM's control routes as methods, written once over ``control`` and ``control_json``.

``ControlPlane`` (over HTTP) and the in-process vLLM engine (``engines.vllm.inprocess``, the
routes as ``AsyncLLM`` calls) both derive from :class:`ControlRoutes`: each supplies how one
request reaches every engine, and the route methods (their paths, parameters and the check
of what each answers) are the same for both.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TypeVar

from engines.types import PauseMode
from trainer.errors import InferenceServerError

__all__ = ["ControlRoutes"]

T = TypeVar("T")


class ControlRoutes(abc.ABC):
    """``pause``, ``resume``, ``sleep``, ``wake_up``, ``is_paused``, ``is_sleeping``,
    ``reset_prefix_cache`` and ``get_world_size`` on every engine, for a class that can send
    one control request to all of them (:meth:`control`, :meth:`control_json`)."""

    @property
    @abc.abstractmethod
    def urls(self) -> Sequence[str]:
        """The engines control calls reach, in the order their answers come back."""

    @abc.abstractmethod
    async def control(
        self,
        method: str,
        path: str,
        params: Mapping[str, Any] | None = None,
        json: Any = None,
    ) -> list[Any]:
        """``method path`` on every engine concurrently; their answers, in URL order."""

    @abc.abstractmethod
    async def control_json(
        self, method: str, path: str, params: Mapping[str, Any] | None = None, json: Any = None
    ) -> list[Any]:
        """:meth:`control`, each answer as its decoded JSON body (None when empty)."""

    async def pause(self, mode: PauseMode = "keep") -> None:
        """``POST /pause?mode=...`` on every engine (keep: freeze, abort: end, wait: drain)."""
        await self.control("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        """``POST /resume`` on every engine."""
        await self.control("POST", "/resume")

    async def sleep(self, level: int = 1, mode: PauseMode | None = None) -> None:
        """``POST /sleep?level=...`` on every engine (1: offload weights, 2: discard them).

        ``mode`` says what happens to in-flight requests, as for :meth:`pause`; None leaves
        it to the engine (vLLM's default: abort)."""
        params: dict[str, Any] = {"level": level}
        if mode is not None:
            params["mode"] = mode
        await self.control("POST", "/sleep", params=params)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """``POST /wake_up`` (``tags``: ``weights`` and/or ``kv_cache``; None or empty: both)."""
        tag_list = list(tags) if tags is not None else []
        await self.control("POST", "/wake_up", params={"tags": tag_list} if tag_list else None)

    async def is_paused(self) -> list[bool]:
        """``GET /is_paused`` of every engine."""
        return await self._field("/is_paused", "is_paused", bool)

    async def is_sleeping(self) -> list[bool]:
        """``GET /is_sleeping`` of every engine."""
        return await self._field("/is_sleeping", "is_sleeping", bool)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """``POST /reset_prefix_cache`` on every engine (``reset_running_requests``: vLLM also
        preempts the requests in flight, which it recomputes; without it, an engine with
        running requests leaves its cache as it is)."""
        params = {"reset_running_requests": "true"} if reset_running_requests else None
        await self.control("POST", "/reset_prefix_cache", params)

    async def get_world_size(self) -> list[int]:
        """``GET /get_world_size`` of every engine: its weight-receiving ranks."""
        return await self._field("/get_world_size", "world_size", int)

    async def _field(self, path: str, key: str, kind: type[T]) -> list[T]:
        """``GET path``'s ``key`` of every engine; ``InferenceServerError`` (naming the engine)
        for an answer that is not a JSON object holding a ``kind`` there."""
        out: list[T] = []
        for url, value in zip(self.urls, await self.control_json("GET", path)):
            field = value.get(key) if isinstance(value, dict) else None
            if not isinstance(field, kind):
                raise InferenceServerError(
                    url, path, 200, f"expected a JSON object with {key!r}: {value!r:.200}"
                )
            out.append(field)
        return out
