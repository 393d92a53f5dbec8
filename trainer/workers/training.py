"""What the policy and critic workers share: micro-batches, AdamW with a linear warm-up,
clipping and stepping, activation checkpointing, and summing a mini-batch's metrics over its micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

__all__ = [
    "Optimizer",
    "add_metrics",
    "enable_activation_checkpointing",
    "extreme",
    "micro_batches",
]


def micro_batches(n: int, size: int | None) -> list[slice]:
    """The slices of ``n`` rows in micro-batches of ``size`` (None: one)."""
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


class Optimizer:
    """A model's AdamW and its linear learning-rate warm-up over ``warmup_steps`` steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        warmup_steps: int,
        max_grad_norm: float,
    ) -> None:
        self.model = model
        self._adamw = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self._warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.rebuild()

    def rebuild(self) -> None:
        """A fresh optimizer and schedule over the model's parameters (after sharding)."""
        warmup = self._warmup_steps
        self.optimizer = torch.optim.AdamW(self.model.parameters(), **self._adamw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0
        )

    def step(self) -> tuple[float, float]:
        """Clip the gradients, step optimizer and schedule, zero the gradients:
        ``(grad_norm before clipping, the learning rate now)``."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), float(self.scheduler.get_last_lr()[0])


def extreme(key: str) -> Callable[[Iterable[float]], float] | None:
    """How the metric ``key`` folds over micro-batches, ranks and mini-batches when its name
    says it is an extreme (``*_max`` by max, ``*_min`` by min); None for any other metric,
    which each fold treats as a mean or a sum. The one place that reads the suffixes."""
    if key.endswith("_max"):
        return max
    if key.endswith("_min"):
        return min
    return None


def add_metrics(
    totals: dict[str, float],
    metrics: dict[str, float],
    weight: float,
    *,
    summed: tuple[str, ...] = (),
) -> None:
    """Fold one micro-batch's ``metrics`` into the mini-batch's ``totals``: ``*_max``/``*_min``
    by max/min, the ``summed`` keys (a loss already normalized by the mini-batch's counts, a
    count) by sum, any other as a mean weighted by ``weight``, the micro-batch's share of the
    mini-batch's trained tokens."""
    for key, v in metrics.items():
        if fold := extreme(key):
            totals[key] = fold((totals[key], v)) if key in totals else v
        elif key in summed:
            totals[key] = totals.get(key, 0.0) + v
        else:
            totals[key] = totals.get(key, 0.0) + v * weight


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each layer's activations in the backward pass (``workers.gradient_checkpointing``).
    transformers >= 5.x names it ``activation_checkpointing_enable`` (the old name warns)."""
    kwargs = {"use_reentrant": False}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if callable(enable):
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)  # type: ignore[operator]
