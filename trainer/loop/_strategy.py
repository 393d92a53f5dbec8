"""The step strategy (``trainer.strategy``), decided once: what feeds the steps, how a step
runs, and whether rollouts go on while the policy trains and syncs.

:func:`make_strategy` builds it from the config and the training prompts; nothing else asks
which strategy runs. Both share one skeleton, :func:`trainer.loop._sync.run_training`: the
first weight sync, then each step under its deadline and the watchdog, recorded, with eval
where due. A strategy supplies the step (:meth:`Strategy.steps`), the data position a
checkpoint keeps, and the engine its rollouts see.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, cast

from engines.types import EngineClient
from trainer.config import Config
from trainer.data import Example, PromptLoader
from trainer.loop._prompt_stream import PromptStream
from trainer.loop._rollout_versions import VersionedEngine
from trainer.loop._versions import WeightVersions

if TYPE_CHECKING:
    from trainer.loop._context import RunContext

__all__ = ["FullyAsyncStrategy", "Strategy", "SyncStrategy", "make_strategy"]

#: One step: its number in, its metrics out.
StepFn = Callable[[int], Awaitable[dict[str, Any]]]


class Strategy(Protocol):
    name: ClassVar[str]
    #: Whether rollouts go on while the policy trains and syncs (the sync's bracket differs).
    rollouts_continue: ClassVar[bool]
    loader: PromptLoader
    versions: WeightVersions

    @property
    def order(self) -> PromptLoader | PromptStream:
        """What holds the data position: saved in a checkpoint, loaded on resume."""
        ...

    def rollout_engine(self, engine: EngineClient, cfg: Config) -> EngineClient:
        """The engine the training generator sees."""
        ...

    def steps(self, ctx: RunContext) -> AbstractAsyncContextManager[StepFn]:
        """``async with strategy.steps(ctx) as step:`` what runs around the steps, and one step."""
        ...

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        """The strategy's own metrics of a finished step."""
        ...


class SyncStrategy:
    """Generate, train, sync, in turn: a batch of prompts per step from the loader."""

    name: ClassVar[str] = "sync"
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
        from trainer.loop._sync import run_step

        async def step(n: int) -> dict[str, Any]:
            return await run_step(ctx, n)

        yield step

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        return {}


class FullyAsyncStrategy:
    """Rollout tasks keep generating, one group at a time from the prompt stream, while the
    policy trains; weights synced every ``trainer.fully_async.sync_interval`` steps."""

    name: ClassVar[str] = "fully_async"
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
        from trainer.loop._fully_async import rolling_out

        async with rolling_out(ctx, self.prompts) as step:
            yield step

    def step_metrics(self, metrics: dict[str, Any], step_s: float) -> dict[str, float]:
        return {"async/trainer_idle_ratio": metrics["timing/wait_for_generation_buffer"] / step_s}


def make_strategy(cfg: Config, examples: list[Example]) -> SyncStrategy | FullyAsyncStrategy:
    """``trainer.strategy``'s strategy over the training prompts."""
    t = cfg.trainer
    loader = PromptLoader(examples, t.train_batch_size, t.seed)
    if t.strategy == "fully_async":
        return FullyAsyncStrategy(loader, PromptStream(examples, t.seed, t.epochs))
    return SyncStrategy(loader)
