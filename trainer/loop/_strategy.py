"""The step strategy (``trainer.strategy``), decided once: what feeds the steps, how a step
runs, and whether rollouts go on while the policy trains and syncs.

:func:`make_strategy` builds it from the config and the training prompts; nothing else asks
which strategy runs. Both share one skeleton, :func:`trainer.loop._steps.run_training`: the
first weight sync, then each step under its deadline and the watchdog, recorded, with eval
where due. A strategy supplies the step (:meth:`Strategy.steps`), the data position a
checkpoint keeps, and the engine its rollouts see (the :class:`~trainer.loop._context.Strategy`
protocol, beside the run context that holds it).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, ClassVar, cast

from engines.types import EngineClient
from trainer.config import Config, Strategy
from trainer.data import Example, PromptLoader
from trainer.loop._context import RunContext, StepFn
from trainer.loop._fully_async import rolling_out
from trainer.loop._prompt_stream import PromptStream
from trainer.loop._rollout_versions import VersionedEngine
from trainer.loop._steps import run_step
from trainer.loop._versions import WeightVersions

__all__ = ["FullyAsyncStrategy", "SyncStrategy", "make_strategy"]


class SyncStrategy:
    """Generate, train, sync, in turn: a batch of prompts per step from the loader."""

    rollouts_continue: ClassVar[bool] = False

    def __init__(self, loader: PromptLoader) -> None:
        self.loader = loader
        self.versions = WeightVersions()

    @property
    def order(self) -> PromptLoader:
        return self.loader

    def rollout_engine(self, engine: EngineClient, cfg: Config) -> EngineClient:
        return engine

    @asynccontextmanager
    async def steps(self, ctx: RunContext) -> AsyncIterator[StepFn]:
        async def step(n: int) -> dict[str, Any]:
            return await run_step(ctx, n)

        yield step

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        return {}


class FullyAsyncStrategy:
    """Rollout tasks keep generating, one group at a time from the prompt stream, while the
    policy trains; weights synced every ``trainer.fully_async.sync_interval`` steps."""

    rollouts_continue: ClassVar[bool] = True

    def __init__(self, loader: PromptLoader, prompts: PromptStream) -> None:
        self.loader = loader  # fixes nothing but the step count here
        self.prompts = prompts
        self.versions = WeightVersions()

    @property
    def order(self) -> PromptStream:
        return self.prompts

    def rollout_engine(self, engine: EngineClient, cfg: Config) -> EngineClient:
        # labels every sampled token with the weight version that produced it
        return cast(EngineClient, VersionedEngine(engine, self.versions, cfg.engine.pause_mode))

    @asynccontextmanager
    async def steps(self, ctx: RunContext) -> AsyncIterator[StepFn]:
        async with rolling_out(ctx, self.prompts) as step:
            yield step

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        return {"async/trainer_idle_ratio": metrics["timing/wait_for_generation_buffer"] / step_s}


def make_strategy(cfg: Config, examples: list[Example]) -> SyncStrategy | FullyAsyncStrategy:
    """``trainer.strategy``'s strategy over the training prompts."""
    t = cfg.trainer
    loader = PromptLoader(examples, t.train_batch_size, t.seed)
    if cfg.plan.strategy is Strategy.FULLY_ASYNC:
        return FullyAsyncStrategy(loader, PromptStream(examples, t.seed, t.epochs))
    return SyncStrategy(loader)
