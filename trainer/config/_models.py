"""The trained models' sections: the policy's model and optimizer, and the critic."""

from __future__ import annotations

import attrs

from trainer.config._fields import at_least, positive
from trainer.config._fields import config_field as _field
from trainer.config._fields import config_section as _section

__all__ = ["CriticConfig", "CriticModelConfig", "LoraConfig", "ModelConfig", "OptimConfig"]


def _target_modules(v: tuple[str, ...]) -> str | None:
    if not v or any(not isinstance(m, str) or not m for m in v):
        return "must name at least one module (q_proj, v_proj, ...) or be [all-linear]"
    if "all-linear" in v and len(v) > 1:
        return "all-linear stands alone: it already names every linear layer but the LM head"
    return None


@attrs.define
class LoraConfig:
    rank: int = _field(
        0,
        "LoRA rank r (peft): > 0 trains a low-rank adapter on the frozen model instead of "
        "every weight (the optimizer state and checkpoints hold the adapter only); 0: full "
        "fine-tuning. As verl's lora_rank and SkyRL's lora.rank.",
        check=at_least(0),
    )
    alpha: int = _field(
        16, "LoRA alpha: the adapter's update is scaled by alpha / rank.", check=positive
    )
    dropout: float = _field(
        0.0,
        "Dropout on the adapter's input (training passes only).",
        check=lambda v: None if 0 <= v < 1 else "must be in [0, 1)",
    )
    target_modules: tuple[str, ...] = _field(
        ("all-linear",),
        "The layers that get an adapter, by module name (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj for Llama-like models), or [all-linear]: every linear "
        "layer but the LM head (peft's shorthand).",
        check=_target_modules,
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@attrs.define
class ModelConfig:
    path: str | None = _field(
        None,
        "Hugging Face causal-LM directory, a .gguf file, or a packaged GGUF model's short "
        "name (smollm2-135m-instruct); None: the built-in tiny model.",
    )
    lora: LoraConfig = _section(
        LoraConfig,
        "Train a LoRA adapter instead of the full model (docs/lora.md).",
        switch="model.lora.rank=R (the adapter's rank, e.g. 8; 0 is off)",
    )


@attrs.define
class OptimConfig:
    lr: float = _field(1e-3, "AdamW learning rate.", check=positive)
    weight_decay: float = _field(0.0, "AdamW weight decay.", check=at_least(0))
    betas: tuple[float, float] = _field((0.9, 0.99), "AdamW betas.")
    max_grad_norm: float = _field(1.0, "Gradient clipping norm.", check=positive)
    warmup_steps: int = _field(
        0, "Linear learning-rate warm-up, in optimizer steps.", check=at_least(0)
    )


@attrs.define
class CriticModelConfig:
    path: str | None = _field(
        None,
        "Hugging Face directory of the critic's model: a causal LM gets a fresh scalar value "
        "head, a saved critic (a checkpoint's critic/) keeps its own (None: the policy's "
        "model.path with a fresh head).",
    )


@attrs.define
class CriticConfig:
    model: CriticModelConfig = _section(CriticModelConfig, "The critic's model.")
    optim: OptimConfig = _section(OptimConfig, "The critic's optimizer (its own).")
    value_clip: float | None = _field(
        0.5,
        "PPO's value clipping: how far a prediction may move from the value the batch was "
        "scored with before its loss stops pulling it (None: no clipping).",
        check=lambda v: None if v is None or v > 0 else "must be > 0 (or None: no clipping)",
    )
    warmup_steps: int = _field(
        0,
        "Steps at the start of the run in which only the critic trains (the policy waits for "
        "its values to mean something; verl's trainer.critic_warmup). Not the learning-rate "
        "warm-up, which is critic.optim.warmup_steps.",
        check=at_least(0),
    )
