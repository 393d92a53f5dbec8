"""``engine.backend=inprocess``: the reference engine inside the trainer, no HTTP.

Offers the same surface as ``engines.client.InferenceClient`` (data plane and the control
plane the trainer uses), ``generate`` inside ``operation("generate")`` and each control call
inside ``operation("/path")``, each with its fault hook, so the trainer cannot tell the two
apart. Useful for tests and debugging; the HTTP path is what runs against real vLLM.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import torch

from engines.local.engine import LocalEngine, open_local_engine
from engines.types import Completion, PauseMode, SamplingParams, nth_sample_params
from trainer.vocabulary import fire_fault, open_owner_nursery, operation

__all__ = ["InProcessClient", "open_inprocess_client"]


class InProcessClient:
    """Drives one in-process :class:`LocalEngine` like an ``InferenceClient`` drives servers."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.urls = ["inprocess://0"]

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        """Sample one completion inside ``operation("generate")``, where its fault fires."""
        with operation("generate"):
            await fire_fault("generate")
            return await self.engine.generate(prompt_ids, sampling)

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        """``n`` completions (sample ``i`` seeded ``seed + i``), all joining the same batch;
        one ``operation("generate")`` and one fault hook, as one HTTP request would have."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        results: list[Completion | None] = [None] * n

        async def one(i: int) -> None:
            results[i] = await self.engine.generate(prompt_ids, nth_sample_params(sampling, i))

        with operation("generate"):
            await fire_fault("generate")
            async with open_owner_nursery() as nursery:
                for i in range(n):
                    nursery.start_soon(one, i)
        return [c for c in results if c is not None]

    async def max_model_len(self) -> int | None:
        """The engine's context (prompt plus completion tokens), as its server reports it."""
        return self.engine.max_model_len

    async def pause(self, mode: PauseMode = "keep") -> None:
        with operation("/pause"):
            await fire_fault("/pause")
            await self.engine.pause(mode)

    async def resume(self) -> None:
        with operation("/resume"):
            await fire_fault("/resume")
            self.engine.resume()

    async def sleep(self, level: int = 1, mode: PauseMode | None = None) -> None:
        with operation("/sleep"):
            await fire_fault("/sleep")
            await self.engine.sleep(level, "abort" if mode is None else mode)

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        with operation("/wake_up"):
            await fire_fault("/wake_up")
            await self.engine.wake_up(None if tags is None else list(tags))

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Nothing to drop (the engine has no prefix cache, and loading weights drops its KV
        caches: kept requests are recomputed); the operation and its fault are there."""
        with operation("/reset_prefix_cache"):
            await fire_fault("/reset_prefix_cache")

    async def load_weights(
        self, named: dict[str, torch.Tensor], *, weight_version: int | None = None
    ) -> None:
        """Replace the engine's weights between two decode steps; they are ``weight_version``
        (None: the engine's count plus one)."""
        await self.engine.load_weights(named, weight_version=weight_version)

    async def weight_checksums(self) -> list[str]:
        return [self.engine.weight_checksum()]


@asynccontextmanager
async def open_inprocess_client(
    model_dir: str | Path, *, seed: int = 0, device: str = "auto"
) -> AsyncIterator[InProcessClient]:
    """The trainer's in-process engine: its logprobs are the sampling distribution's
    (``processed_logprobs``), as the trainer computes its own."""
    async with open_local_engine(
        model_dir, seed=seed, device=device, logprobs_mode="processed_logprobs"
    ) as engine:
        yield InProcessClient(engine)
