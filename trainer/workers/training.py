"""What the policy and critic workers share: micro-batches (by rows or by a token budget), AdamW with a linear warm-up,
clipping and stepping, activation checkpointing, and summing a mini-batch's metrics over its micro-batches."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Required, TypedDict, Unpack

import attrs
import torch
import torch.distributed as dist

from trainer.workers.batch import TrainBatch
from trainer.workers.fsdp import is_sharded

__all__ = [
    "MicroBatching",
    "OptimArgs",
    "Optimizer",
    "add_metrics",
    "enable_activation_checkpointing",
    "extreme",
    "micro_batches",
    "start_training",
    "token_budget_micro_batches",
    "trainable_parameters",
]


def micro_batches(n: int, size: int | None) -> list[slice]:
    """The slices of ``n`` rows in micro-batches of ``size`` (None: one)."""
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def token_budget_micro_batches(
    lengths: Sequence[int], max_tokens: int, max_rows: int | None = None
) -> list[list[int]]:
    """The rows of sequences of ``lengths`` packed into micro-batches of at most ``max_tokens``
    padded tokens each (``rows * its longest length``) and at most ``max_rows`` rows (None:
    any number): longest first, each micro-batch filled greedily with the next longest, so
    rows of like lengths share one and little padding is left. A sequence longer than
    ``max_tokens`` goes alone in its micro-batch. Every row is in exactly one micro-batch;
    the row order inside each is ascending."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    out: list[list[int]] = []
    width = 0
    for i in order:
        rows = out[-1] if out else []
        full = (len(rows) + 1) * width > max_tokens or len(rows) == (max_rows or len(lengths))
        if not rows or full:
            out.append([i])
            width = lengths[i]  # the longest of the new micro-batch
        else:
            rows.append(i)
    return [sorted(rows) for rows in out]


#: A micro-batch's rows of its batch: a range (by ``micro_batch_size``) or a list (packed by
#: tokens); None for a pass that only keeps FSDP2's ranks in step.
Rows = slice | list[int] | None


@attrs.frozen
class MicroBatching:
    """How a worker cuts a batch into forward (and backward) passes
    (``trainer.micro_batch_size``, ``trainer.micro_batch_max_tokens``).

    Without ``max_tokens``: ranges of ``size`` rows in order (None: the whole batch in one).
    With it: :func:`token_budget_micro_batches`, at most ``max_tokens`` padded tokens and at
    most ``size`` rows each. Either way each micro-batch is padded only to its own longest row
    (:meth:`TrainBatch.trimmed`). The loss is normalised by the whole mini-batch's counts, so
    the cut never changes the gradient (beyond float rounding).
    """

    #: Rows per micro-batch at most (None: no limit).
    size: int | None = None
    #: Padded tokens (rows times the longest row) per micro-batch at most (None: off).
    max_tokens: int | None = None

    def plan(self, batch: TrainBatch) -> list[slice] | list[list[int]]:
        """The micro-batches' rows of ``batch``."""
        if self.max_tokens is None:
            return micro_batches(len(batch), self.size)
        return token_budget_micro_batches(batch.lengths, self.max_tokens, self.size)

    def split(self, batch: TrainBatch, model: torch.nn.Module) -> Iterator[tuple[Rows, TrainBatch]]:
        """Each micro-batch of ``batch``, trimmed, with its rows. A sharded ``model`` (FSDP2)
        needs every rank in every pass, and packing by tokens gives ranks different numbers of
        passes: the ranks agree on the most (a collective), and one with fewer adds passes of
        one row whose loss mask is 0 (rows None)."""
        plan = self.plan(batch)
        idle = 0
        if self.max_tokens is not None and is_sharded(model) and len(batch):
            passes = torch.tensor([len(plan)], device=next(model.parameters()).device)
            dist.all_reduce(passes, op=dist.ReduceOp.MAX)  # before any pass: they are collectives
            idle = int(passes) - len(plan)
        yield from ((rows, batch.select(rows).trimmed()) for rows in plan)
        for _ in range(idle):
            one = batch.select([0]).trimmed()
            one.loss_mask = torch.zeros_like(one.loss_mask)
            yield None, one


class OptimArgs(TypedDict, total=False):
    """An optimizer's settings (``optim.*``, ``critic.optim.*``) as a worker's keyword
    arguments; unset ones take :class:`Optimizer`'s defaults."""

    lr: Required[float]
    betas: tuple[float, float]
    weight_decay: float
    warmup_steps: int
    max_grad_norm: float


class Optimizer:
    """A model's AdamW and its linear learning-rate warm-up over ``warmup_steps`` steps."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
    ) -> None:
        self.model = model
        self._adamw = {"lr": lr, "betas": betas, "weight_decay": weight_decay}
        self._warmup_steps = warmup_steps
        self.max_grad_norm = max_grad_norm
        self.rebuild()

    def rebuild(self) -> None:
        """A fresh optimizer and schedule over the model's trainable parameters (after
        sharding; a LoRA policy's adapter alone)."""
        warmup = self._warmup_steps
        self.params = trainable_parameters(self.model)
        self.optimizer = torch.optim.AdamW(self.params, **self._adamw)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) if warmup else 1.0
        )

    def step(self) -> tuple[float, float]:
        """Clip the gradients, step optimizer and schedule, zero the gradients:
        ``(grad_norm before clipping, the learning rate now)``."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(grad_norm), float(self.scheduler.get_last_lr()[0])


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """``model``'s parameters that train (``requires_grad``): all of a fully fine-tuned
    model's, a LoRA policy's adapter alone."""
    return [p for p in model.parameters() if p.requires_grad]


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


def start_training(
    model: torch.nn.Module, *, gradient_checkpointing: bool, **optim: Unpack[OptimArgs]
) -> Optimizer:
    """``model`` in training mode, its activations recomputed in the backward pass when
    ``gradient_checkpointing``, and its optimizer: how the policy and the critic start."""
    model.train()
    if gradient_checkpointing:
        enable_activation_checkpointing(model)
    return Optimizer(model, **optim)
