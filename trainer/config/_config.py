"""The root of the configuration tree: :class:`Config`, one field per section, and the run
plan it makes (:attr:`Config.plan`). Apart from the sections (:mod:`trainer.config._schema`)
so that the plan reads the sections and the root reads the plan, with no circle."""

from __future__ import annotations

import functools

import attrs

from trainer.config._data import DataConfig
from trainer.config._engine import EngineConfig, SyncConfig
from trainer.config._fields import config_field as _field
from trainer.config._fields import config_section as _section
from trainer.config._models import CriticConfig, ModelConfig, OptimConfig
from trainer.config._plan import RunPlan, plan_run
from trainer.config._schema import AlgorithmConfig, GeneratorConfig, TrainerConfig
from trainer.config._serve import ServeConfig
from trainer.config._workers import WorkersConfig

__all__ = ["Config"]


@attrs.define
class Config:
    trainer: TrainerConfig = _section(TrainerConfig, "The step loop.")
    generator: GeneratorConfig = _section(GeneratorConfig, "Rollout generation.")
    engine: EngineConfig = _section(EngineConfig, "Inference engines.")
    sync: SyncConfig = _section(SyncConfig, "Weight sync from the policy to the engines.")
    workers: WorkersConfig = _section(WorkersConfig, "Policy and reference workers.")
    model: ModelConfig = _section(ModelConfig, "The policy model.")
    algorithm: AlgorithmConfig = _section(AlgorithmConfig, "Advantages and losses.")
    optim: OptimConfig = _section(OptimConfig, "Optimizer.")
    critic: CriticConfig = _section(
        CriticConfig,
        "The critic (value model) of algorithm.advantage_estimator=gae.",
        switch="algorithm.advantage_estimator=gae (the estimator that reads values)",
    )
    data: DataConfig = _section(DataConfig, "Prompts and rewards.")
    serve: ServeConfig = _section(
        ServeConfig, "python -m trainer serve: the Tinker-protocol training service."
    )
    faults: str = _field(
        "",
        "Fault injection 'OP:ACTION[@STEPS],...' to rehearse timeouts (see docs/troubleshooting.md).",
        env="TRAINER_FAULTS",
    )

    @functools.cached_property
    def plan(self) -> RunPlan:
        """The run plan (:class:`~trainer.config.RunPlan`): every decision the run acts on,
        made once from this config; the run's parts read it. Validation builds it, so a
        decision this machine cannot honour (a CUDA device without one) fails at load."""
        return plan_run(self)
