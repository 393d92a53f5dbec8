"""vLLM's control routes as methods, written once over ``control``.

``ControlPlane`` (over HTTP) and the in-process vLLM engine (``engines.vllm.inprocess``, the
routes as ``AsyncLLM`` calls) both derive from :class:`ControlRoutes`: each supplies how one
request reaches every engine, and the route methods (their paths, parameters and the check
of what each answers) are the same for both.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TypeVar

from engines.types import JSONValue, PauseMode, QueryParams
from trainer.errors import InferenceServerError

__all__ = ["ControlRoutes", "digests_checksum"]

T = TypeVar("T")


def digests_checksum(digests: Mapping[str, object]) -> str:
    """One sha256 over vLLM's per-parameter weight digests (its sorted ``name:digest`` lines)."""
    pairs = "".join(f"{k}:{v}\n" for k, v in sorted(digests.items()))
    return hashlib.sha256(pairs.encode()).hexdigest()


class ControlRoutes(abc.ABC):
    """``pause``, ``resume``, ``sleep``, ``wake_up``, ``is_paused``, ``is_sleeping``,
    ``reset_prefix_cache``, ``get_world_size`` and ``weight_checksums`` on every engine, for a class that can send
    one control request to all of them (:meth:`control`)."""

    @property
    @abc.abstractmethod
    def urls(self) -> Sequence[str]:
        """The engines control calls reach, in the order their answers come back."""

    @abc.abstractmethod
    async def control(
        self,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> list[JSONValue]:
        """``method path`` on every engine concurrently; their answers (each its JSON body,
        None when empty), in URL order."""

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
        params: dict[str, int | str] = {"level": level}
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

    async def weight_checksums(self) -> list[str]:
        """One sha256 per server over its loaded weights (``POST /weight_checker`` checksum).

        The reference server's ``checksum`` field equals
        ``engines.local.model_weights.state_checksum`` of the same state dict; for vLLM (which
        returns only per-parameter digests) it is a sha256 over the sorted ``name:digest``
        pairs. vLLM answers 409 while paused or asleep.
        """
        path = "/weight_checker"
        values = await self.control("POST", path, json={"action": "checksum"})
        out = []
        for url, value in zip(self.urls, values):
            body = value if isinstance(value, dict) else {}
            checksum, digests = body.get("checksum"), body.get("checksums")
            if isinstance(checksum, str):
                out.append(checksum)
            elif isinstance(digests, dict):
                out.append(digests_checksum(digests))
            else:
                raise InferenceServerError(
                    url, path, 200, f"not a weight_checker answer: {value!r:.200}"
                )
        return out

    async def _field(self, path: str, key: str, kind: type[T]) -> list[T]:
        """``GET path``'s ``key`` of every engine; ``InferenceServerError`` (naming the engine)
        for an answer that is not a JSON object holding a ``kind`` there."""
        out: list[T] = []
        for url, value in zip(self.urls, await self.control("GET", path)):
            field = value.get(key) if isinstance(value, dict) else None
            if not isinstance(field, kind):
                raise InferenceServerError(
                    url, path, 200, f"expected a JSON object with {key!r}: {value!r:.200}"
                )
            out.append(field)
        return out
