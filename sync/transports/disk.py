"""``sync.transport=disk``: safetensors files plus vLLM's four-phase weight-transfer routes.

Rank 0 writes its parameters in buckets of at most ``bucket_bytes`` (one safetensors file
each, written by the worker in its own thread: no second full copy of the model in memory),
and the engines read each bucket as it is announced:

    POST /init_weight_transfer_engine  {"init_info": {"backend": "disk"}}      once
    POST /start_weight_update          {}
    POST /update_weights               {"update_info": {"names", "dtype_names", "shapes", "path"}}  per bucket
    POST /finish_weight_update         {}    the engine applies the staged weights atomically

The files live under ``directory`` (the run directory's ``weight_sync/``) and are deleted
after each sync; the engines must see the same filesystem (the same machine, or a shared
mount).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import trio

__all__ = ["DiskTransport"]


class DiskTransport:
    def __init__(self, directory: Path, bucket_bytes: int) -> None:
        self.directory = Path(directory)
        self.bucket_bytes = bucket_bytes
        self._version = 0

    async def init(self, engine: Any, workers: Any) -> None:
        await engine.control(
            "POST", "/init_weight_transfer_engine", json={"init_info": {"backend": "disk"}}
        )

    async def transfer(self, workers: Any, engine: Any) -> None:
        self._version += 1
        target = self.directory / f"v{self._version}"
        try:
            buckets = await workers.export_weights(target, self.bucket_bytes)
            await engine.control("POST", "/start_weight_update", json={})
            for bucket in buckets:
                await engine.control("POST", "/update_weights", json={"update_info": bucket})
            await engine.control("POST", "/finish_weight_update", json={})
        finally:
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(shutil.rmtree, target, True)
