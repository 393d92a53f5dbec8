"""The critic worker: a value model trained beside the policy (``algorithm.advantage_estimator=gae``).

A plain synchronous torch object, like :class:`trainer.workers.policy.PolicyWorker`: the
policy's architecture with a scalar value head (transformers' ``*ForTokenClassification`` with
one label, as verl's and SkyRL's critics), its own AdamW and warm-up, PPO's clipped value loss
(:func:`trainer.algorithms.value_loss`). ``critic.model.path`` a causal LM: its body with a
fresh head (initialised from the seed, the same on every rank); a saved critic: its own head.

Position ``t`` of a batch's ``[B, L - 1]`` values is the value of the state before token
``t + 1`` (the prompt and the response up to token ``t``), aligned with the loss mask and the
policy's logprobs. The critic is not offloaded with the policy (``engine.colocated``): it
stays on its device.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Unpack

import torch

from engines.devices import resolve_device, resolve_dtype
from trainer import algorithms
from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import load_model, load_state, save_model, save_state
from trainer.errors import CheckpointError
from trainer.workers.batch import TrainBatch
from trainer.workers.fsdp import is_sharded, shard_model
from trainer.workers.training import OptimArgs, add_metrics, micro_batches, start_training

__all__ = ["CRITIC_FILES", "CriticWorker"]

log = logging.getLogger("trainer.workers")

#: The critic's part of a checkpoint: its model (a Hugging Face directory that
#: ``AutoModelForTokenClassification`` loads, and ``critic.model.path`` accepts), its
#: optimizer and schedule.
CRITIC_FILES = ("critic", "critic_optimizer.pt", "critic_scheduler.pt")


def _load_value_model(model_dir: str | Path, seed: int, device, dtype) -> torch.nn.Module:
    """``model_dir`` as a token classifier with one label and no dropout before the head; a
    fresh head is drawn from ``seed`` without touching the process's random stream."""
    from transformers import AutoConfig, AutoModelForTokenClassification
    from transformers.utils import logging as hf_logging

    config = AutoConfig.from_pretrained(model_dir)
    fresh = (
        config.num_labels != 1
        or not config.architectures
        or not any(a.endswith("ForTokenClassification") for a in config.architectures)
    )
    config.num_labels = 1
    config.classifier_dropout = 0.0
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report: the LM head unused, the value head new
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForTokenClassification.from_pretrained(
                model_dir, config=config, dtype=dtype
            )
    finally:
        hf_logging.set_verbosity(verbosity)
    log.info("critic: %s, %s value head", model_dir, "a fresh" if fresh else "its own")
    return torch.nn.Module.to(model, device)


class CriticWorker:
    """The value model, its optimizer and PPO's clipped value loss."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        value_clip: float | None = 0.5,
        micro_batch_size: int | None = None,
        seed: int = 0,
        device: str = "auto",
        dtype: str = "auto",
        gradient_checkpointing: bool = False,
        **optim: Unpack[OptimArgs],
    ) -> None:
        self.device = resolve_device(device)
        self.model = _load_value_model(
            model_dir, seed, self.device, resolve_dtype(dtype, self.device)
        )
        self._optim = start_training(
            self.model, gradient_checkpointing=gradient_checkpointing, **optim
        )
        self.value_clip = value_clip
        self.micro_batch_size = micro_batch_size

    def shard(self) -> None:
        """Shard with FSDP2 over the default process group, as the policy
        (:meth:`trainer.workers.policy.PolicyWorker.shard`)."""
        shard_model(self.model)
        self._optim.rebuild()

    @property
    def sharded(self) -> bool:
        return is_sharded(self.model)

    def _values(self, batch: TrainBatch) -> torch.Tensor:
        out = self.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
        return out.logits[:, :-1, 0].float()

    @torch.no_grad()
    def compute_values(self, batch: TrainBatch) -> torch.Tensor:
        """The value of each position, ``[B, L - 1]`` float32 on the CPU (no grad)."""
        parts = [
            self._values(batch.select(s).to(self.device)).cpu()
            for s in micro_batches(len(batch), self.micro_batch_size)
        ]
        return torch.cat(parts, dim=0)

    def forward_backward(
        self, batch: TrainBatch, counts: BatchCounts | None = None
    ) -> dict[str, float]:
        """Accumulate the value loss's gradients over ``batch`` in micro-batches, normalized by
        ``counts`` (the whole mini-batch's; default the batch's own), so micro-batches and
        data-parallel ranks add up to one call's gradient. The batch must carry ``values``
        (what it was scored with) and ``returns``. Metrics ``critic/vf_loss``,
        ``critic/vf_clip_frac``, ``critic/vpred_mean``."""
        if batch.values is None or batch.returns is None:
            raise ValueError("the critic trains on a batch with values and returns; this has none")
        counts = counts or batch.counts
        num_tokens = max(1, counts.tokens)
        totals: dict[str, float] = {}
        for s in micro_batches(len(batch), self.micro_batch_size):
            mb = batch.select(s).to(self.device)
            assert mb.values is not None and mb.returns is not None
            loss, metrics = algorithms.value_loss(
                self._values(mb),
                mb.values,
                mb.returns,
                mb.loss_mask,
                clip=self.value_clip,
                counts=counts,
            )
            loss.backward()
            if mb.num_tokens == 0:  # rows that only keep FSDP2's ranks in step
                continue
            weight = float(mb.loss_mask.sum()) / num_tokens
            add_metrics(
                totals,
                {f"critic/{k}": v for k, v in metrics.items()},
                weight,
                summed=("critic/vf_loss",),
            )
        return totals

    def optim_step(self) -> dict[str, float]:
        """Clip, step optimizer and schedule, zero: ``critic/grad_norm``, ``critic/lr``."""
        grad_norm, lr = self._optim.step()
        return {"critic/grad_norm": grad_norm, "critic/lr": lr}

    def save_checkpoint(self, directory: Path) -> None:
        """Write :data:`CRITIC_FILES` into ``directory`` (beside the policy's)."""
        model, optimizer, scheduler = (directory / name for name in CRITIC_FILES)
        save_model(self.model, model)
        save_state(self._optim.optimizer.state_dict(), optimizer)
        save_state(self._optim.scheduler.state_dict(), scheduler)

    def load_checkpoint(self, directory: Path) -> None:
        """Read :data:`CRITIC_FILES` back; ``CheckpointError`` for a checkpoint without a
        critic (a run of an estimator that trains none)."""
        model, optimizer, scheduler = (directory / name for name in CRITIC_FILES)
        if not model.is_dir():
            raise CheckpointError(
                f"{directory} holds no critic ({CRITIC_FILES[0]}/): it was saved by a run "
                "without one; resume it with the algorithm.advantage_estimator it was trained "
                "with, or start this run from its policy (model.path=.../policy)"
            )
        load_model(self.model, model)
        self._optim.optimizer.load_state_dict(load_state(optimizer))
        self._optim.scheduler.load_state_dict(load_state(scheduler))
