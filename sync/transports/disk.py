"""``sync.transport=disk``: safetensors files plus vLLM's four-phase weight-transfer routes.

Rank 0 writes its parameters in buckets of at most ``bucket_bytes`` (one safetensors file
each, written where rank 0 runs: no second full copy of the model in memory), and the
engines read each bucket as it is announced::

    POST /init_weight_transfer_engine  {"init_info": {"backend": "disk"}}      once
    POST /start_weight_update          {}
    POST /update_weights               {"update_info": {"names", "dtype_names", "shapes", "path"}}  per bucket
    POST /finish_weight_update         {"weight_version": "N"}    the engine applies the staged weights atomically

``N`` is the trainer's weight version (:func:`~sync.transports.base.finish_body`; ``{}``
when the caller gives none).

The files live under ``directory`` (the run directory's ``weight_sync/``, made private on the
first sync and removed, empty, when the transport closes) and are deleted after each sync; the engines must see the same filesystem (the same machine, or a shared
mount). The engine side is ``engines/local/weight_routes.py`` (backend ``disk``).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import torch
import trio

from engines.types import EngineClient
from sync.transports.base import (
    Rank0,
    TransportSettings,
    finish_body,
    make_sync_dir,
    remove_if_empty,
    routes_of,
)
from sync.transports.buckets import plan_buckets, update_bytes, update_info

__all__ = ["REMOVE_BOUND_S", "DiskTransport", "write_buckets"]

log = logging.getLogger(__name__)

#: How long a transfer waits for its bucket files to be removed before going on without.
REMOVE_BOUND_S = 30.0


def _remove_leftovers(directory: Path) -> None:
    """Remove what an earlier transfer could not (its removal was cut off at its bound)."""
    for old in directory.glob("v*"):
        shutil.rmtree(old, ignore_errors=True)


def write_buckets(
    model: torch.nn.Module, directory: str, bucket_bytes: int
) -> list[dict[str, object]]:
    """Rank 0: write the parameters as safetensors buckets; one ``update_info`` (+ ``path``) each."""
    from safetensors.torch import save_file  # only rank 0's process of a disk sync needs it

    target = Path(directory)
    make_sync_dir(target)
    infos = []
    for i, bucket in enumerate(plan_buckets(model.named_parameters(), bucket_bytes)):
        path = target / f"bucket_{i}.safetensors"
        save_file({name: t.detach().contiguous() for name, t in bucket}, str(path))
        infos.append({**update_info(bucket), "path": str(path.resolve())})
    return infos


class DiskTransport:
    """Bucket files written by rank 0, read by every engine (see the module docstring)."""

    @classmethod
    def from_settings(cls, settings: TransportSettings) -> DiskTransport:
        return cls(settings.directory, settings.bucket_bytes)

    def __init__(self, directory: Path, bucket_bytes: int) -> None:
        self.directory = Path(directory)
        self.bucket_bytes = bucket_bytes
        self._version = 0
        #: Tensor bytes of the last transfer (``sync/bytes``).
        self.last_bytes = 0

    async def init(self, engine: EngineClient, workers: Rank0) -> None:
        await routes_of(engine).control(
            "POST", "/init_weight_transfer_engine", json={"init_info": {"backend": "disk"}}
        )

    async def transfer(
        self, engine: EngineClient, workers: Rank0, *, weight_version: int | None = None
    ) -> None:
        routes = routes_of(engine)
        self._version += 1
        target = self.directory / f"v{self._version}"
        await trio.to_thread.run_sync(_remove_leftovers, self.directory)
        try:
            buckets = await workers.run_on_rank0(write_buckets, str(target), self.bucket_bytes)
            self.last_bytes = update_bytes(buckets)
            await routes.control("POST", "/start_weight_update", json={})
            for bucket in buckets:
                await routes.control("POST", "/update_weights", json={"update_info": bucket})
            await routes.control("POST", "/finish_weight_update", json=finish_body(weight_version))
        finally:
            # shielded, so a failed or cancelled sync removes its files too, but bounded: a
            # disk that does not answer must not hold the sync (the next transfer retries)
            with trio.move_on_after(REMOVE_BOUND_S, shield=True) as bound:
                await trio.to_thread.run_sync(shutil.rmtree, target, True, abandon_on_cancel=True)
            if bound.cancelled_caught:
                log.warning(
                    "could not remove %s within %gs (a slow disk?): the next transfer removes it",
                    target,
                    REMOVE_BOUND_S,
                )

    async def close(self, workers: Rank0) -> None:
        await trio.to_thread.run_sync(remove_if_empty, self.directory)
