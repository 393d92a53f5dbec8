"""The policy and reference workers: plain synchronous torch objects.

They know nothing of trio: a worker group calls their methods from a worker thread (local
backend) or inside an actor process (Ray backend), so every method may block.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from trainer import algorithms
from trainer.checkpoint_io import (
    load_model,
    load_state,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
)
from trainer.off_policy import DEFAULT_TIS_CAP, OffPolicyCorrection, importance_weights
from trainer.workers.batch import TrainBatch

__all__ = ["PolicyWorker", "RefWorker", "preload_model_code"]


def preload_model_code(model_dir: str | Path) -> None:
    """Import the code that builds ``model_dir``'s model (transformers' modeling module for
    its architecture: seconds of imports) without building it. Blocking: run it in a thread,
    e.g. while the engine servers start."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(model_dir)
    MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]  # imports the architecture's modeling module


def _load_model(model_dir: str | Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


class RefWorker:
    """A frozen copy of the initial policy; computes reference logprobs for the KL penalty."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        temperature: float = 1.0,
        micro_batch_size: int | None = None,
    ) -> None:
        self.model = _load_model(model_dir)
        self.model.eval()
        self.model.requires_grad_(False)
        self.temperature = temperature
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Logprob of each next token, ``[B, L - 1]``."""
        return _logprobs(self.model, batch, self.temperature, self.micro_batch_size)


def _micro_batches(n: int, size: int | None) -> list[slice]:
    size = size or n
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]


def _forward_logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float
) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    return algorithms.token_logprobs(logits[:, :-1, :], batch.input_ids[:, 1:], temperature)


def _logprobs(
    model: torch.nn.Module, batch: TrainBatch, temperature: float, micro: int | None
) -> torch.Tensor:
    parts = [
        _forward_logprobs(model, batch.select(s), temperature)
        for s in _micro_batches(len(batch), micro)
    ]
    return torch.cat(parts, dim=0)


class PolicyWorker:
    """The trained policy: model, AdamW optimizer and warm-up scheduler."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
        temperature: float = 1.0,
        clip_ratio_low: float = 0.2,
        clip_ratio_high: float = 0.2,
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "k3",
        micro_batch_size: int | None = None,
        seed: int = 0,
        off_policy_correction: OffPolicyCorrection = "none",
        tis_cap: float | None = DEFAULT_TIS_CAP,
    ) -> None:
        torch.manual_seed(seed)
        self.model = _load_model(model_dir)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=betas, weight_decay=weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: min(1.0, (s + 1) / (warmup_steps + 1)) if warmup_steps else 1.0,
        )
        self.max_grad_norm = max_grad_norm
        self.temperature = temperature
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_type = kl_loss_type
        self.micro_batch_size = micro_batch_size
        self.off_policy_correction: OffPolicyCorrection = off_policy_correction
        self.tis_cap = tis_cap

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """The current policy's logprob of each next token, ``[B, L - 1]`` (no grad)."""
        return _logprobs(self.model, batch, self.temperature, self.micro_batch_size)

    def forward_backward(
        self, batch: TrainBatch, num_tokens: int | None = None
    ) -> dict[str, float]:
        """Accumulate gradients of the PPO-clip loss (+ KL) over ``batch`` in micro-batches.

        The loss is a token mean over ``num_tokens`` (default: the batch's own count), so
        micro-batching and gradient accumulation give the same gradient as one pass.

        With ``off_policy_correction="tis"`` each token's term is weighted by
        ``min(exp(old - rollout), tis_cap)`` (:mod:`trainer.off_policy`); the batch must then
        carry ``rollout_logprobs`` (``ValueError`` otherwise). With ``"none"`` the loss is
        the plain PPO-clip loss, and a batch with ``rollout_logprobs`` still reports the
        ``policy/is_ratio_*`` metrics.
        """
        assert batch.advantages is not None and batch.old_logprobs is not None
        if self.off_policy_correction != "none" and batch.rollout_logprobs is None:
            raise ValueError(
                f"off_policy_correction={self.off_policy_correction!r} needs the batch's "
                "rollout_logprobs (the sampler's logprobs); this batch has none"
            )
        num_tokens = num_tokens or max(1, batch.num_tokens)
        totals: dict[str, float] = {}
        for s in _micro_batches(len(batch), self.micro_batch_size):
            mb = batch.select(s)
            assert mb.old_logprobs is not None and mb.advantages is not None
            weights, is_metrics = None, {}
            if mb.rollout_logprobs is not None:
                weights, is_metrics = importance_weights(
                    mb.old_logprobs,
                    mb.rollout_logprobs,
                    mb.loss_mask,
                    self.off_policy_correction,
                    cap=self.tis_cap,
                )
            logprobs = _forward_logprobs(self.model, mb, self.temperature)
            loss, metrics = algorithms.policy_loss(
                logprobs,
                mb.old_logprobs,
                mb.advantages,
                mb.loss_mask,
                clip_low=self.clip_ratio_low,
                clip_high=self.clip_ratio_high,
                num_tokens=num_tokens,
                token_weights=weights,
            )
            metrics |= is_metrics
            weight = float(mb.loss_mask.sum()) / num_tokens
            if self.kl_loss_coef and mb.ref_logprobs is not None:
                kl = algorithms.kl_penalty(logprobs, mb.ref_logprobs, kind=self.kl_loss_type)  # type: ignore[arg-type]
                kl_loss = algorithms.masked_sum(kl, mb.loss_mask) / num_tokens
                loss = loss + self.kl_loss_coef * kl_loss
                totals["policy/kl"] = totals.get("policy/kl", 0.0) + float(kl_loss.detach())
            loss.backward()
            totals["policy/loss"] = totals.get("policy/loss", 0.0) + float(loss.detach())
            for k, v in metrics.items():
                key = f"policy/{k}"
                if k.endswith("_max"):
                    totals[key] = max(totals.get(key, -math.inf), v)
                elif k.endswith("_min"):
                    totals[key] = min(totals.get(key, math.inf), v)
                elif k == "num_tokens":
                    totals[key] = totals.get(key, 0.0) + v
                else:  # token-weighted mean over micro-batches
                    totals[key] = totals.get(key, 0.0) + v * weight
        return totals

    def optim_step(self) -> dict[str, float]:
        """Clip gradients, step optimizer and scheduler, zero gradients."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {
            "policy/grad_norm": float(grad_norm),
            "policy/lr": float(self.scheduler.get_last_lr()[0]),
        }

    def offload_to_cpu(self) -> None:
        """Move optimizer state and gradients to host memory (a no-op on a CPU-only run)."""

    def backload_to_gpu(self) -> None:
        """Bring optimizer state back to the accelerator (a no-op on a CPU-only run)."""

    def save_checkpoint(self, directory: Path) -> None:
        """Write model (HF-loadable), optimizer, scheduler and RNG states into ``directory``."""
        save_model(self.model, directory / "policy")
        save_state(self.optimizer.state_dict(), directory / "optimizer.pt")
        save_state(self.scheduler.state_dict(), directory / "scheduler.pt")
        save_state(rng_state(), directory / "rng.pt")

    def load_checkpoint(self, directory: Path) -> None:
        load_model(self.model, directory / "policy")
        self.optimizer.load_state_dict(load_state(directory / "optimizer.pt"))
        self.scheduler.load_state_dict(load_state(directory / "scheduler.pt"))
        set_rng_state(load_state(directory / "rng.pt"))
