"""``algorithm.distillation``: on-policy distillation (Thinking Machines' "On-Policy
Distillation", tinker-cookbook's ``distillation`` recipe). A teacher model, served by an engine
the trainer starts, scores the student's sampled tokens; each trained token's advantage is the
negative reverse KL, ``reverse_kl_coef * (teacher logprob - student logprob)``, plus
``reward_weight`` times the task's advantage. docs/algorithms.md#on-policy-distillation.
"""

from __future__ import annotations

from typing import Literal, Protocol

import attrs

from trainer.config._fields import at_least
from trainer.config._fields import config_field as _field
from trainer.errors import ConfigError

__all__ = ["DistillationConfig", "check_distillation"]

#: ``engine.backend`` values whose vLLM settings a ``teacher_engine=vllm`` teacher takes.
_VLLM_BACKENDS = ("vllm", "vllm_inprocess")


@attrs.define
class DistillationConfig:
    teacher_path: str | None = _field(
        None,
        "The teacher model (as model.path takes one: a Hugging Face directory, e.g. one "
        "'ckpt export' wrote, a .gguf file or a packaged name); set, the run distills it into "
        "the policy (docs/algorithms.md#on-policy-distillation). It must share the policy's "
        "tokenizer. None: no distillation.",
    )
    teacher_engine: Literal["local", "vllm"] = _field(
        "local",
        "What serves the teacher: local, a reference engine server the trainer starts; vllm, "
        "a 'vllm serve' the trainer starts with the run's vLLM settings (engine.backend=vllm "
        "or vllm_inprocess). It scores with vLLM's prompt_logprobs.",
    )
    reverse_kl_coef: float = _field(
        1.0,
        "The weight of the negative reverse KL in each token's advantage: "
        "coef * (teacher logprob - student logprob) (tinker-cookbook's kl_penalty_coef).",
        check=at_least(0),
    )
    reward_weight: float = _field(
        0.0,
        "The weight of the task's advantage (algorithm.advantage_estimator of the reward) "
        "added to each token's; 0: the teacher alone teaches.",
        check=at_least(0),
    )

    @property
    def enabled(self) -> bool:
        """Whether the run distills a teacher (``teacher_path`` set)."""
        return self.teacher_path is not None


class _Config(Protocol):
    @property
    def algorithm(self) -> _Algorithm: ...
    @property
    def engine(self) -> _Engine: ...


class _Algorithm(Protocol):
    @property
    def distillation(self) -> DistillationConfig: ...


class _Engine(Protocol):
    @property
    def backend(self) -> str: ...


def check_distillation(cfg: _Config) -> None:
    """``ConfigError`` (one line) for a distillation the run cannot serve or that teaches
    nothing."""
    d = cfg.algorithm.distillation
    if not d.enabled:
        return
    if d.teacher_engine == "vllm" and cfg.engine.backend not in _VLLM_BACKENDS:
        raise ConfigError(
            "config: algorithm.distillation.teacher_engine='vllm' starts 'vllm serve' with the "
            f"run's vLLM settings, but engine.backend={cfg.engine.backend!r} has none; use "
            "engine.backend=vllm, or teacher_engine=local (the reference engine)"
        )
    if d.reverse_kl_coef == 0 and d.reward_weight == 0:
        raise ConfigError(
            "config: algorithm.distillation.reverse_kl_coef=0 and reward_weight=0 leave every "
            "advantage 0; set reverse_kl_coef > 0 (the teacher's term), or unset teacher_path"
        )
