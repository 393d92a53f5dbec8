"""The policy and reference workers: plain synchronous torch objects.

They know nothing of trio: a worker group calls their methods from a worker thread (local
backend) or inside an actor process (Ray backend), so every method may block.

Device and dtype (``workers.device``, ``workers.dtype``) are resolved here, in the process that
holds the model (:mod:`trainer.workers.device`); batches move to the model's device and
logprobs come back on the CPU. With ``offload=True`` (an engine colocated on the same GPU)
``offload_to_cpu`` moves parameters, gradients and optimizer state to host memory and
``backload_to_gpu`` brings them back (:mod:`trainer.workers.offload`); a compute call on an
offloaded policy brings it back first. On the CPU both are no-ops that report 0 bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Unpack

import torch

from engines.devices import resolve_device, resolve_dtype
from trainer import algorithms
from trainer.algorithms import BatchCounts
from trainer.checkpoint.format import (
    load_model,
    load_state,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
)
from trainer.off_policy import RolloutCorrection, correction_weights
from trainer.workers.batch import TrainBatch
from trainer.workers.fsdp import (
    GatheredModel,
    gathered_model,
    is_sharded,
    shard_model,
    unsharded_in_turn,
)
from trainer.workers.logprobs import forward_logprobs, forward_logprobs_entropy
from trainer.workers.lora import (
    AdapterCopy,
    LoraCheckpoint,
    LoraSpec,
    MergedWeights,
    add_adapter,
    is_adapter_parameter,
    merged_copy,
)
from trainer.workers.offload import Offloaded, offload_training_state, restore_training_state
from trainer.workers.training import MicroBatching, OptimArgs, add_metrics, start_training

__all__ = ["OFFLOAD_METRICS", "PolicyWorker", "RefWorker", "preload_model_code"]

#: The step metrics of offload and backload: bytes moved off and back onto the device.
OFFLOAD_METRICS = ("workers/offload_bytes", "workers/backload_bytes")
_CPU = torch.device("cpu")


def preload_model_code(model_dir: str | Path) -> None:
    """Import the code that builds ``model_dir``'s model (transformers' modeling module for
    its architecture: seconds of imports) without building it. Blocking: run it in a thread,
    e.g. while the engine servers start."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(model_dir)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the architecture's modeling module


def _load_model(model_dir: str | Path, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return torch.nn.Module.to(model, device)


class RefWorker:
    """A frozen copy of the initial policy; computes reference logprobs for the KL penalty."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
        micro_batch_max_tokens: int | None = None,
        device: str = "auto",
        dtype: str = "auto",
    ) -> None:
        self.device = resolve_device(device)
        self.model = _load_model(model_dir, self.device, resolve_dtype(dtype, self.device))
        self.model.eval()
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batching = MicroBatching(micro_batch_size, micro_batch_max_tokens)

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprob of each trained next token, ``[B, L - 1]`` (0 where ``loss_mask`` is), on the CPU."""
        return _logprobs(self.model, batch, self.temperature, self.micro_batching, self.device)


def _logprobs(
    model: torch.nn.Module,
    batch: TrainBatch,
    temperature: float,
    plan: MicroBatching,
    device: torch.device,
) -> torch.Tensor:
    """Float32 logprobs ``[B, L - 1]`` on the CPU (0 where ``loss_mask`` is), computed on
    ``device`` micro-batch by micro-batch, each padded only to its own longest row."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float32)
    for rows, mb in plan.split(batch, model):
        logprobs = forward_logprobs(model, mb.to(device), temperature).cpu()
        if rows is not None:
            out[rows, : logprobs.shape[1]] = logprobs
    return out


class PolicyWorker:
    """The trained policy: model, AdamW optimizer and warm-up scheduler.

    ``gradient_checkpointing`` recomputes each layer's activations in the backward pass
    (less memory, about a third more compute). ``offload`` makes ``offload_to_cpu`` real
    on an accelerator (see the module docstring). ``lora``: the model is frozen and a LoRA
    adapter trains (:mod:`trainer.workers.lora`); the optimizer and the checkpoints hold the
    adapter alone, and the weight transports read the merged weights.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        temperature: float = 1.0,
        policy_loss: str = "ppo",
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        clip_ratio_c: float | None = None,
        loss_agg_mode: str = "token-mean",
        loss_options: Mapping[str, float] | None = None,
        loss_scale_factor: float | None = None,
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "k3",
        entropy_coeff: float = 0.0,
        micro_batch_size: int | None = None,
        micro_batch_max_tokens: int | None = None,
        seed: int = 0,
        rollout_correction: RolloutCorrection | None = None,
        device: str = "auto",
        dtype: str = "auto",
        gradient_checkpointing: bool = False,
        offload: bool = False,
        lora: LoraSpec | None = None,
        **optim: Unpack[OptimArgs],
    ) -> None:
        torch.manual_seed(seed)
        self.device = resolve_device(device)
        self.model = _load_model(model_dir, self.device, resolve_dtype(dtype, self.device))
        self._lora: LoraCheckpoint | None = None
        self._merged: MergedWeights | None = None
        self.lora = lora
        if lora is not None:
            self.model = add_adapter(self.model, lora)
            self._lora = LoraCheckpoint(self.model, model_dir)
            self._merged = MergedWeights(self.model) if lora.merged else None
        self._optim = start_training(
            self.model, gradient_checkpointing=gradient_checkpointing, **optim
        )
        self.offload = offload
        self._offloaded: Offloaded | None = None
        #: Bytes a compute call brought back implicitly, reported by the next backload.
        self._restored_unreported = 0
        self.temperature = temperature
        self.policy_loss = policy_loss
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.clip_ratio_c = clip_ratio_c
        self.loss_agg_mode = loss_agg_mode
        #: The policy loss's own parameters (``algorithm.clip_cov``/``kl_cov``; None: defaults).
        self.loss_options = loss_options
        self.loss_scale_factor = loss_scale_factor
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_type = kl_loss_type
        #: The entropy bonus's weight (``algorithm.entropy_coeff``; 0: off, no entropy taken).
        self.entropy_coeff = entropy_coeff
        self.micro_batching = MicroBatching(micro_batch_size, micro_batch_max_tokens)
        self.rollout_correction = rollout_correction or RolloutCorrection()

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self._optim.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self._optim.scheduler

    def shard(self) -> None:
        """Shard the model with FSDP2 over the default process group (data parallel on
        GPUs; :mod:`trainer.workers.fsdp`), then rebuild optimizer and scheduler over the
        shards. Call it once, before the first step, on every rank."""
        shard_model(self.model)
        self._merged = None  # its tensors were the unsharded parameters: read in turns now
        self._optim.rebuild()

    def readable_model(self, *, keep: bool = True) -> torch.nn.Module:
        """The model whose ``named_parameters`` are the full weights (what a weight
        transport reads). Sharded (FSDP2), the weights are gathered first, a collective
        every rank joins (``keep`` False on the ranks that do not read them). With a LoRA
        adapter, the merged weights (:class:`~trainer.workers.lora.MergedWeights`), or the
        peft model itself where the engines load the adapter (``LoraSpec.merged`` False);
        sharded, copies of those: the adapter's tensors gathered alone, the merged weights
        taken one FSDP module at a time while it is unsharded on every rank."""
        if self._merged is not None:
            self._resident()
            return self._merged.fresh()
        if not is_sharded(self.model):
            return self.model
        self._resident()
        if self.lora is None:
            return gathered_model(self.model, keep=keep)
        if not self.lora.merged:  # the adapter alone, gathered tensor by tensor
            adapter = gathered_model(self.model, keep=keep, only=is_adapter_parameter)
            return AdapterCopy(self.model, dict(adapter.named_parameters())) if keep else adapter
        # the merged weights: peft computes on full tensors, one FSDP module's at a time
        merged: dict[str, torch.Tensor] = {}
        for _ in unsharded_in_turn(self.model):  # every rank joins each all-gather
            if keep:
                merged |= merged_copy(self.model, done=merged)
        if not keep:
            return self.model
        config = getattr(self.model.get_base_model(), "config", None)  # type: ignore[operator]
        return GatheredModel(merged, config)

    def _resident(self) -> None:
        """Bring an offloaded policy back before it computes."""
        if self._offloaded is not None:
            self._restored_unreported += restore_training_state(self._offloaded)
            self._offloaded = None

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's logprob of each trained next token, ``[B, L - 1]`` (no grad; 0
        where ``loss_mask`` is), on the CPU."""
        self._resident()
        return _logprobs(self.model, batch, self.temperature, self.micro_batching, self.device)

    def forward_backward(
        self, batch: TrainBatch, counts: BatchCounts | None = None
    ) -> dict[str, float]:
        """Accumulate gradients of the policy loss (+ KL) over ``batch`` in micro-batches.

        The loss (``policy_loss``, aggregated by ``loss_agg_mode``; the KL term alike) is
        normalized by ``counts``, those of the whole mini-batch (default: the batch's own), so
        micro-batching, gradient accumulation and data parallel give the same gradient as one
        pass over the mini-batch.

        With ``rollout_correction.rollout_is`` set each token's term is weighted by its
        importance weight (token or sequence TIS, :mod:`trainer.off_policy`); the batch must
        then carry ``rollout_logprobs`` (``ValueError`` otherwise). Without it the loss is the
        plain loss, and a batch with ``rollout_logprobs`` still reports the
        ``policy/is_ratio_*`` metrics. (Rejection masks are the loop's: they have already
        left the batch's ``loss_mask``.)

        A batch without ``old_logprobs`` takes them from this pass's own forward (detached):
        exact when this pass is the batch's only optimizer step (the weights it scores with
        are the ones the rollouts are measured against), and it saves a forward of the batch.
        """
        assert batch.advantages is not None
        if self.rollout_correction.rollout_is is not None and batch.rollout_logprobs is None:
            raise ValueError(
                f"rollout_is={self.rollout_correction.rollout_is!r} needs the batch's "
                "rollout_logprobs (the sampler's logprobs); this batch has none"
            )
        self._resident()
        counts = counts or batch.counts
        num_tokens = max(1, counts.tokens)
        totals: dict[str, float] = {}
        for _, part in self.micro_batching.split(batch, self.model):
            mb = part.to(self.device)
            padding = mb.num_tokens == 0  # rows that only keep FSDP2's ranks in step
            loss, metrics, kl_loss, sums = self._micro_batch_loss(mb, counts)
            weight = float(mb.loss_mask.sum()) / num_tokens
            if kl_loss is not None:
                totals["policy/kl"] = totals.get("policy/kl", 0.0) + float(kl_loss.detach())
            loss.backward()
            if padding:
                continue
            totals["policy/loss"] = totals.get("policy/loss", 0.0) + float(loss.detach())
            add_metrics(
                totals,
                {f"policy/{k}": v for k, v in metrics.items()},
                weight,
                # pg_loss, entropy: each micro-batch's share of the mini-batch's, as loss
                summed=("policy/num_tokens", "policy/pg_loss", "policy/entropy"),
            )
            algorithms.fold_mismatch_sums(totals, sums)
        return totals

    def _micro_batch_loss(
        self, mb: TrainBatch, counts: BatchCounts
    ) -> tuple[torch.Tensor, dict[str, float], torch.Tensor | None, dict[str, float]]:
        """One micro-batch's forward: its loss (the policy loss, less the entropy bonus, plus the
        weighted KL term), the policy loss's metrics with the importance ratio's (and
        ``entropy``, the aggregated entropy, where the bonus is on), the KL term (None when
        off or the batch has no ``ref_logprobs``), and the mismatch diagnostics' sums where
        this forward is the old policy's (no ``old_logprobs``: the loop recomputed none), else
        ``{}``."""
        assert mb.advantages is not None
        entropy = None
        if self.entropy_coeff:
            logprobs, entropy = forward_logprobs_entropy(self.model, mb, self.temperature)
        else:
            logprobs = forward_logprobs(self.model, mb, self.temperature)
        old = logprobs.detach() if mb.old_logprobs is None else mb.old_logprobs
        weights, is_metrics, sums = None, {}, {}
        if mb.rollout_logprobs is not None:
            if mb.old_logprobs is None:
                sums = algorithms.mismatch_sums(old, mb.rollout_logprobs, mb.loss_mask)
            weights, is_metrics = correction_weights(
                old, mb.rollout_logprobs, mb.loss_mask, self.rollout_correction
            )
        loss, metrics = algorithms.policy_loss(
            logprobs,
            old,
            mb.advantages,
            mb.loss_mask,
            loss=self.policy_loss,
            clip_low=self.clip_ratio_low,
            clip_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c,
            loss_agg_mode=self.loss_agg_mode,
            counts=counts,
            scale_factor=self.loss_scale_factor,
            token_weights=weights,
            loss_options=self.loss_options,
        )
        metrics |= is_metrics
        if entropy is not None:  # verl's entropy_coeff: the bonus, aggregated as the loss is
            agg = algorithms.aggregate(
                entropy,
                mb.loss_mask,
                self.loss_agg_mode,
                counts,
                scale_factor=self.loss_scale_factor,
            )
            loss = loss - self.entropy_coeff * agg
            metrics["entropy"] = float(agg.detach())
        if not self.kl_loss_coef or mb.ref_logprobs is None:
            return loss, metrics, None, sums
        kl = algorithms.kl_penalty(logprobs, mb.ref_logprobs, kind=self.kl_loss_type)  # type: ignore[arg-type]
        kl_loss = algorithms.aggregate(
            kl, mb.loss_mask, self.loss_agg_mode, counts, scale_factor=self.loss_scale_factor
        )
        return loss + self.kl_loss_coef * kl_loss, metrics, kl_loss, sums

    def optim_step(self) -> dict[str, float]:
        """Clip gradients, step optimizer and scheduler, zero gradients."""
        self._resident()
        grad_norm, lr = self._optim.step()
        if self._merged is not None:
            self._merged.stale = True
        return {"policy/grad_norm": grad_norm, "policy/lr": lr}

    def offload_to_cpu(self) -> dict[str, float]:
        """Move parameters, gradients and optimizer state to (pinned) host memory and free
        the device's cache; ``workers/offload_bytes`` is what moved. A no-op reporting 0
        on the CPU, without ``offload``, or when already offloaded."""
        moved = 0
        if self.offload and self.device.type != "cpu" and self._offloaded is None:
            self._offloaded = offload_training_state(
                self.model, self.optimizer, self.device, _CPU, pin_memory=True
            )
            moved = self._offloaded.nbytes
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return {"workers/offload_bytes": float(moved)}

    def backload_to_gpu(self) -> dict[str, float]:
        """Bring what ``offload_to_cpu`` moved back to the device; ``workers/backload_bytes``
        counts it (and what a compute call brought back since the last report)."""
        self._resident()
        moved, self._restored_unreported = self._restored_unreported, 0
        return {"workers/backload_bytes": float(moved)}

    def save_checkpoint(self, directory: Path) -> None:
        """Write model (HF-loadable; a LoRA policy's adapter as a peft directory), optimizer,
        scheduler and RNG states into ``directory``."""
        if self._lora is not None:
            self._lora.save(directory / "policy")
        else:
            save_model(self.model, directory / "policy")
        save_state(self.optimizer.state_dict(), directory / "optimizer.pt")
        save_state(self.scheduler.state_dict(), directory / "scheduler.pt")
        save_state(rng_state(), directory / "rng.pt")

    def load_checkpoint(self, directory: Path) -> None:
        self._resident()
        if self._lora is not None:
            self._lora.load(directory / "policy")
            if self._merged is not None:
                self._merged.stale = True
        else:
            load_model(self.model, directory / "policy")
        self.optimizer.load_state_dict(load_state(directory / "optimizer.pt"))
        self.scheduler.load_state_dict(load_state(directory / "scheduler.pt"))
        set_rng_state(load_state(directory / "rng.pt"))
