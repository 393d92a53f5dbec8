"""``sync.lora=adapter``: a LoRA policy's adapter, not its weights, reaches the engines.

Rank 0 writes the adapter as peft writes it (``adapter_config.json``,
``adapter_model.safetensors``: a few MB where the model is hundreds) into a directory of its
own for each sync, ``RUN_DIR/weight_sync/lora_vN``, and every engine loads it in place under
the served name::

    POST /v1/load_lora_adapter  {"lora_name": "policy", "lora_path": ".../lora_vN", "load_inplace": true}

as SkyRL and prime-rl sync adapters to vLLM. Completions then name the adapter (their
``model``), so the engines sample through it; the base weights never move. A new directory per
sync, because vLLM does not invalidate prefix-cache blocks of an adapter reloaded from the same
path (its log says so). The earlier directories are removed once the newest is loaded
everywhere (a re-sent transfer, or a restarted engine's resync, writes a new one).

A load is one control call per engine, the whole transfer: a failure leaves the engines with
their previous adapter (vLLM swaps it whole) and paused (the bracket's rule), and the transfer
can be sent again. The engine side is vLLM's own route, and the reference engine's
``engines/local/lora_routes.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import trio

from engines.types import EngineClient
from sync.transports.base import Rank0, make_sync_dir, remove_if_empty, routes_of

__all__ = ["LoraAdapterTransport", "write_adapter"]


def write_adapter(model: torch.nn.Module, directory: str) -> int:
    """Rank 0: the policy's adapter (a peft model's ``save_pretrained``) into ``directory``;
    the bytes written."""
    target = Path(directory)
    make_sync_dir(target)
    model.save_pretrained(directory)  # type: ignore[operator]
    return sum(f.stat().st_size for f in target.iterdir() if f.is_file())


class LoraAdapterTransport:
    """The adapter, written by rank 0 and loaded in place by every engine (module docstring)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory = Path(directory)
        self.name = name
        self._version = 0
        #: Bytes of the last adapter written (``sync/lora_adapter_bytes``).
        self.last_bytes = 0

    async def init(self, engine: EngineClient, workers: Rank0) -> None:
        routes_of(engine)  # a client of servers (TypeError for one without routes)

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None:
        self._version += 1
        target = self.directory / f"lora_v{self._version}"
        self.last_bytes = await workers.run_on_rank0(write_adapter, str(target))
        body = {"lora_name": self.name, "lora_path": str(target.resolve()), "load_inplace": True}
        await routes_of(engine).control("POST", "/v1/load_lora_adapter", json=body)
        await trio.to_thread.run_sync(self._remove_older, target.name)

    def _remove_older(self, keep: str) -> None:
        """Remove the adapters of earlier syncs (blocking)."""
        for old in self.directory.glob("lora_v*"):
            if old.name != keep:
                shutil.rmtree(old, ignore_errors=True)

    async def close(self, workers: Rank0) -> None:
        await trio.to_thread.run_sync(remove_if_empty, self.directory)
