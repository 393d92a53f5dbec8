"""The service's sampling engines: one server per base model (the reference engine's, or
``vllm serve`` with ``engine.backend=vllm``), started as the trainer starts its engines
(:func:`engines.launch.open_engine_processes`, ``--enable-lora``, the trainer's
``--logprobs-mode``), the first time a client samples that model, and stopped when the
service stops.

A sampler's weights are a LoRA adapter that the engine serves by name (a completion whose
``model`` is the name samples through it, any other through the base weights): each sampler
save loads one, through the trainer's own adapter sync
(:class:`sync.transports.LoraAdapterTransport`), and :meth:`SamplerEngine.client` is the
engine as that adapter's client (the completions name it). Every engine task is owned by
the nursery of :func:`open_sampler_engines`; the service's scratch folder (the adapters, the
engines' logs) is private to its user and removed when the service stops.
"""

from __future__ import annotations

import logging
import re
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from engines.client import InferenceClient
from engines.launch import ReferenceServers, new_api_key, open_engine_processes
from engines.vllm.flags import MAX_LORA_RANKS, VllmSettings
from engines.vllm.serve import VllmServers
from sync.transfer import TRANSFER_GRACE_S

__all__ = [
    "MAX_SERVED_RANK",
    "VLLM_MAX_LORA_RANK",
    "SamplerEngine",
    "SamplerEngines",
    "SamplerSettings",
    "open_sampler_engines",
]

log = logging.getLogger(__name__)

#: ``--max-lora-rank`` of the reference engine: vLLM's largest, so every adapter a client can
#: train is served (the reference engine's cost is the adapter's own size).
MAX_SERVED_RANK = MAX_LORA_RANKS[-1]
#: ``--max-lora-rank`` of ``vllm serve``, whose LoRA buffers grow with it: Tinker's default
#: rank is 32; a save of a higher rank is refused by the engine, saying so.
VLLM_MAX_LORA_RANK = 64


@attrs.frozen
class SamplerSettings:
    """What the service's engines and sampler saves read of the configuration."""

    #: ``trainer.seed``: the engine's sampling seed.
    seed: int = 0
    #: ``engine.startup_timeout_s`` (its default for the backend).
    startup_timeout_s: float = 120.0
    #: ``engine.control_plane_timeout_s``.
    control_plane_timeout_s: float = 600.0
    #: ``sync.verify``: ``first`` (each model's first sampler save), ``every`` or ``never``.
    verify: str = "first"
    #: ``sync.verify_tolerance`` (None: by the policy's dtype).
    verify_tolerance: float | None = None
    #: ``sync.transfer_grace_s``.
    transfer_grace_s: float = TRANSFER_GRACE_S
    #: ``engine.pause_mode`` of the pause around each adapter load.
    pause_mode: str = "keep"
    #: torch threads of each engine server (None: the server's default).
    num_threads: int | None = None
    #: ``logprobs_mode`` of the engines (the trainer's: the sampling distribution's).
    logprobs_mode: str | None = None
    #: ``engine.backend=vllm``: the run plan's ``vllm serve`` settings (LoRA on, no weight
    #: transfer: adapters go by route); None: the reference engine.
    vllm: VllmSettings | None = None


@attrs.define(eq=False)
class SamplerEngine:
    """One base model's engine server: its base client and one client per served adapter."""

    base_model: str
    base: InferenceClient
    api_key: str
    log_path: Path
    control_plane_timeout_s: float
    _clients: dict[str, InferenceClient] = attrs.Factory(dict)

    def client(self, adapter: str | None) -> InferenceClient:
        """The engine as ``adapter``'s client (its completions sample through it); the base
        model's for None."""
        if adapter is None:
            return self.base
        if adapter not in self._clients:
            self._clients[adapter] = InferenceClient(
                self.base.urls,
                api_key=self.api_key,
                model=adapter,
                control_plane_timeout_s=self.control_plane_timeout_s,
            )
        return self._clients[adapter]

    async def unload(self, adapter: str) -> None:
        """Stop serving ``adapter`` (vLLM's ``/v1/unload_lora_adapter``) and close its client."""
        client = self._clients.pop(adapter, None)
        try:
            await self.base.control("POST", "/v1/unload_lora_adapter", json={"lora_name": adapter})
        finally:
            if client is not None:
                await client.aclose()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()


class SamplerEngines:
    """The engines by base model, each started on first use by a task of ``nursery``."""

    def __init__(self, settings: SamplerSettings, nursery: trio.Nursery, work_dir: Path) -> None:
        self.settings = settings
        self.work_dir = work_dir
        #: Where sampler adapters are written (the engines' weight folder).
        self.adapter_dir = work_dir / "samplers"
        self._nursery = nursery
        self._engines: dict[str, SamplerEngine] = {}
        self._locks: dict[str, trio.Lock] = {}

    async def engine(self, base_model: str, model_dir: Callable[[], Any]) -> SamplerEngine:
        """``base_model``'s engine, started now when it is not yet (``model_dir``: its
        directory, blocking); ``EngineStartError`` (with the log's tail) when it does not start
        within ``engine.startup_timeout_s``."""
        lock = self._locks.setdefault(base_model, trio.Lock())
        async with lock:
            if base_model not in self._engines:
                path = await trio.to_thread.run_sync(model_dir)
                engine = await self._nursery.start(self._serve, base_model, Path(path))
                self._engines[base_model] = engine
            return self._engines[base_model]

    async def _serve(
        self, base_model: str, model_dir: Path, *, task_status: trio.TaskStatus[SamplerEngine]
    ) -> None:
        s = self.settings
        servers: ReferenceServers | VllmServers = ReferenceServers(
            str(model_dir),
            s.seed,
            num_threads=s.num_threads,
            max_lora_rank=MAX_SERVED_RANK,
            logprobs_mode=s.logprobs_mode,
        )
        if s.vllm is not None:
            servers = VllmServers(attrs.evolve(s.vllm, model=str(model_dir)))
        log_dir = self.work_dir / "engines" / re.sub(r"[^A-Za-z0-9._-]", "_", base_model)
        api_key = new_api_key()
        async with open_engine_processes(
            1,
            servers,
            log_dir,
            api_key=api_key,
            startup_timeout_s=s.startup_timeout_s,
            weight_dir=self.adapter_dir,
        ) as processes:
            async with InferenceClient(
                [p.url for p in processes],
                api_key=api_key,
                control_plane_timeout_s=s.control_plane_timeout_s,
            ) as base:
                engine = SamplerEngine(
                    base_model, base, api_key, processes[0].log_path, s.control_plane_timeout_s
                )
                kind = "vllm serve" if s.vllm is not None else "reference engine"
                log.info(
                    "engine of %s up (%s): %s, log %s",
                    base_model,
                    kind,
                    base.urls[0],
                    engine.log_path,
                )
                try:
                    task_status.started(engine)
                    await trio.sleep_forever()
                finally:
                    self._engines.pop(base_model, None)
                    with trio.CancelScope(shield=True):
                        await engine.aclose()


@asynccontextmanager
async def open_sampler_engines(settings: SamplerSettings) -> AsyncIterator[SamplerEngines]:
    """The service's engines, none started yet; every one started is stopped, and the scratch
    folder removed, when the block exits."""
    work_dir = Path(await trio.to_thread.run_sync(tempfile.mkdtemp, "", "trainer-serve-"))
    try:
        async with trio.open_nursery() as nursery:
            try:
                yield SamplerEngines(settings, nursery, work_dir)
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(shutil.rmtree, work_dir, True)
