"""The routes ``InferenceClient`` may need, the ``vllm serve`` flag behind each, and the probe.

A plain ``vllm serve`` has the OpenAI routes only. The control plane appears with
``VLLM_SERVER_DEV_MODE=1`` (pause/resume, cache, and the rest of the dev routes), sleep needs
``--enable-sleep-mode`` too, and the weight-transfer routes need ``--weight-transfer-config``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import trio

from trainer.errors import InferenceServerError, InferenceServerTimeoutError
from trainer.vocabulary import raise_first

__all__ = [
    "DATA_PLANE_ROUTES",
    "LORA_ROUTES",
    "PAUSE_ROUTES",
    "ROUTE_FLAGS",
    "SLEEP_ROUTES",
    "WEIGHT_TRANSFER_ROUTES",
    "SupportsControlOne",
    "probe",
]

_DEV = "VLLM_SERVER_DEV_MODE=1"
_LORA = "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
#: Route -> (method, what to set on ``vllm serve`` when the route is missing).
ROUTE_FLAGS: Mapping[str, tuple[str, str]] = {
    "/health": ("GET", "nothing (every vllm serve has it): is this a vLLM server?"),
    "/v1/completions": ("POST", "nothing (every vllm serve has it): is this a vLLM server?"),
    "/pause": ("POST", _DEV),
    "/resume": ("POST", _DEV),
    "/is_paused": ("GET", _DEV),
    "/reset_prefix_cache": ("POST", _DEV),
    "/sleep": ("POST", f"--enable-sleep-mode (and {_DEV})"),
    "/wake_up": ("POST", f"--enable-sleep-mode (and {_DEV})"),
    "/is_sleeping": ("GET", f"--enable-sleep-mode (and {_DEV})"),
    "/init_weight_transfer_engine": ("POST", f"--weight-transfer-config (and {_DEV})"),
    "/start_weight_update": ("POST", f"--weight-transfer-config (and {_DEV})"),
    "/update_weights": ("POST", f"--weight-transfer-config (and {_DEV})"),
    "/finish_weight_update": ("POST", f"--weight-transfer-config (and {_DEV})"),
    "/v1/load_lora_adapter": ("POST", f"--enable-lora --max-lora-rank N (and {_LORA})"),
    "/v1/unload_lora_adapter": ("POST", f"--enable-lora --max-lora-rank N (and {_LORA})"),
}
DATA_PLANE_ROUTES = ("/health", "/v1/completions")
PAUSE_ROUTES = ("/pause", "/resume", "/is_paused")
SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping")
#: A LoRA adapter loaded in place and unloaded (``sync.lora=adapter``); their 2xx answer is a
#: sentence, not JSON (vLLM's).
LORA_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
WEIGHT_TRANSFER_ROUTES = (
    "/init_weight_transfer_engine",
    "/start_weight_update",
    "/update_weights",
    "/finish_weight_update",
)


class SupportsControlOne(Protocol):
    """What :func:`probe` needs of a client (:class:`engines.client.ControlPlane` has it)."""

    @property
    def urls(self) -> Sequence[str]: ...

    async def control_one(self, url: str, method: str, path: str) -> object:
        """One control-plane request to ``url``; raises ``InferenceServerError`` for a non-2xx
        answer (or a 2xx one whose body is not JSON)."""
        ...


async def probe(client: SupportsControlOne, required: Iterable[str]) -> None:
    """Check that every server serves ``required`` routes; name the vllm flag when one is missing.

    Side-effect free: a POST route is probed with GET (405 = present, 404 = missing).
    Raises ``InferenceServerError`` (status 404) naming the missing routes and what to
    set on ``vllm serve`` (``VLLM_SERVER_DEV_MODE=1``, ``--enable-sleep-mode``,
    ``--weight-transfer-config``); status 501 when the server has the route but does
    not implement it; ``ValueError`` for a route this client does not know.
    """
    routes = list(dict.fromkeys(required))
    unknown = [r for r in routes if r not in ROUTE_FLAGS]
    if unknown:
        raise ValueError(f"unknown routes {unknown}; known: {', '.join(ROUTE_FLAGS)}")
    errors: dict[int, Exception] = {}

    async def probe_one(i: int, url: str) -> None:
        missing: list[str] = []
        for route in routes:
            try:
                await client.control_one(url, "GET", route)
            except InferenceServerTimeoutError as exc:
                errors[i] = exc
                return
            except InferenceServerError as exc:
                if exc.status == 404:
                    missing.append(route)
                elif exc.status is not None and 200 <= exc.status < 300:
                    continue  # answered, with a body that is not JSON: the route is there
                elif exc.status == 501:
                    detail = f"the server has {route} but does not implement it: {exc.detail}"
                    errors[i] = InferenceServerError(url, route, 501, detail)
                    return
                elif exc.status != 405 or ROUTE_FLAGS[route][0] == "GET":
                    errors[i] = exc
                    return
        if missing:
            flags = "; ".join(f"{r} -> set {ROUTE_FLAGS[r][1]}" for r in missing)
            detail = f"missing routes {missing}: start `vllm serve` with the flags: {flags}"
            errors[i] = InferenceServerError(url, missing[0], 404, detail)

    async with trio.open_nursery() as nursery:
        for i, url in enumerate(client.urls):
            nursery.start_soon(probe_one, i, url)
    if errors:
        raise_first([errors[i] for i in sorted(errors)])
