"""One model of the training service (``python -m trainer serve``): a LoRA policy that
answers the Tinker protocol's ``forward``, ``forward_backward`` and ``optim_step``.

It is a :class:`~trainer.workers.policy.PolicyWorker` with a LoRA adapter (the model, peft's
adapter and AdamW over the adapter alone, as ``python -m trainer`` trains one); what differs is
the unit of work: a list of datums, each a token sequence whose every position ``i`` predicts
``target_tokens[i]`` (any token, not only the next one of the sequence), and a loss of the
service's registry (:data:`trainer.algorithms.DATUM_LOSSES`), summed. Gradients accumulate
across ``forward_backward`` calls until ``optim_step`` applies and clears them, as Tinker's do.

Every method blocks (torch): the service calls them in a thread, one at a time per model.
A ``ValueError`` means the request was wrong (a missing or misshapen input, a token outside the
vocabulary): the client's error, not the service's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import attrs
import numpy as np
import torch

from trainer import algorithms
from trainer.vocabulary import fire_fault_sync
from trainer.workers.lora import LoraSpec
from trainer.workers.policy import PolicyWorker

__all__ = ["AdamStep", "DatumOutput", "ServiceModel"]


@attrs.frozen
class AdamStep:
    """One ``optim_step``'s hyperparameters (the SDK's ``AdamParams``; its defaults)."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    #: Decoupled (AdamW) weight decay.
    weight_decay: float = 0.0
    #: Clip the global gradient norm to this; 0: no clipping.
    grad_clip_norm: float = 0.0


@attrs.frozen
class DatumOutput:
    """What ``forward`` / ``forward_backward`` return: each datum's ``logprobs`` (float32,
    ``[N]``) and the metrics (``loss:sum``)."""

    logprobs: list[np.ndarray]
    metrics: dict[str, float]


class ServiceModel:
    """A base model with a fresh LoRA adapter of ``rank``, trained datum by datum.

    ``seed`` seeds the adapter's initialization (its ``B`` starts at zero, so the untrained
    model is the base model whatever the seed); ``alpha`` is peft's ``lora_alpha``;
    ``target_modules`` the adapted layers (peft's ``all-linear``: every linear layer but the
    LM head).
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        rank: int,
        alpha: int = 16,
        target_modules: tuple[str, ...] = ("all-linear",),
        seed: int = 0,
        device: str = "cpu",
    ) -> None:
        self.worker = PolicyWorker(
            model_dir,
            lora=LoraSpec(rank=rank, alpha=alpha, target_modules=target_modules),
            seed=seed,
            device=device,
            lr=AdamStep().learning_rate,
        )
        self.rank = rank
        self.alpha = alpha
        self.target_modules = target_modules
        self.seed = seed
        self.optim_steps = 0

    @property
    def vocab_size(self) -> int:
        return int(self.worker.model.get_output_embeddings().weight.shape[0])  # type: ignore[operator]

    def forward_backward(
        self,
        data: Sequence[tuple[Sequence[int], Mapping[str, np.ndarray]]],
        loss_fn: str,
        *,
        backward: bool,
        loss_fn_config: Mapping[str, float | str] | None = None,
    ) -> DatumOutput:
        """Each datum's target logprobs and the summed loss ``loss_fn`` over the datums
        (``(tokens, loss_fn_inputs)`` pairs), with ``loss_fn_config``'s keywords; with
        ``backward`` its gradient is added to the adapter's. ``ValueError`` for an unknown
        loss, a bad config or inputs it cannot read.

        The fault point of the operation (``forward`` or ``forward_backward``, DESIGN 4.5)
        fires first, here in the thread that runs it, at step ``optim_steps + 1``: a ``hang``
        really blocks this thread."""
        loss_of = algorithms.DATUM_LOSSES.get(loss_fn)
        config = algorithms.datum_loss_config(loss_fn, loss_fn_config)
        needs = ("target_tokens", *algorithms.DATUM_LOSS_INPUTS[loss_fn])
        fire_fault_sync("forward_backward" if backward else "forward", step=self.optim_steps + 1)
        model = self.worker.model
        model.train(backward)
        total = 0.0
        out: list[np.ndarray] = []
        with torch.set_grad_enabled(backward):
            for i, (tokens, inputs) in enumerate(data):
                targets, extra = self._inputs(i, tokens, inputs, needs)
                ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.worker.device)
                logits = model(input_ids=ids).logits[0]
                logprobs = algorithms.token_logprobs(logits, targets).float()
                loss = loss_of(logprobs, extra, **config)
                if backward:
                    loss.backward()
                total += float(loss.detach())
                out.append(logprobs.detach().cpu().numpy().astype(np.float32))
        return DatumOutput(logprobs=out, metrics={"loss:sum": total})

    def _inputs(
        self,
        i: int,
        tokens: Sequence[int],
        inputs: Mapping[str, np.ndarray],
        needs: tuple[str, ...],
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Datum ``i``'s targets and float inputs as tensors, each checked against its
        tokens; ``ValueError`` naming the datum and the input otherwise."""
        n = len(tokens)
        if n == 0:
            raise ValueError(f"datum {i} has no tokens")
        if min(tokens) < 0 or max(tokens) >= self.vocab_size:
            raise ValueError(f"datum {i}: a token outside the vocabulary [0, {self.vocab_size})")
        missing = [k for k in needs if k not in inputs]
        if missing:
            raise ValueError(
                f"datum {i} lacks loss_fn_inputs {missing} (this loss reads {list(needs)})"
            )
        for k in needs:
            if inputs[k].shape != (n,):
                raise ValueError(
                    f"datum {i}: loss_fn_inputs[{k!r}] has shape {list(inputs[k].shape)}, not "
                    f"[{n}] (one per model-input token; the [N, K] form is not served yet)"
                )
        targets = torch.as_tensor(inputs["target_tokens"], dtype=torch.long)
        if int(targets.min()) < 0 or int(targets.max()) >= self.vocab_size:
            raise ValueError(f"datum {i}: a target token outside the vocabulary")
        device = self.worker.device
        extra = {
            k: torch.as_tensor(inputs[k], dtype=torch.float32, device=device) for k in needs[1:]
        }
        return targets.to(device), extra

    def optim_step(self, step: AdamStep) -> dict[str, float]:
        """Apply the accumulated gradients with AdamW at ``step``'s hyperparameters, then
        clear them. Returns the gradient norm before clipping."""
        optimizer = self.worker.optimizer
        params = [p for group in optimizer.param_groups for p in group["params"]]
        for group in optimizer.param_groups:
            group["lr"] = step.learning_rate
            group["betas"] = (step.beta1, step.beta2)
            group["eps"] = step.eps
            group["weight_decay"] = step.weight_decay
        grads = [p.grad for p in params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        if step.grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(params, step.grad_clip_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self.optim_steps += 1
        return {"grad_norm": norm}

    def save_state(self, directory: Path) -> None:
        """The adapter, the optimizer's state (AdamW's moments and step counts), the
        scheduler's, the RNG's and :attr:`optim_steps` into ``directory`` (a new folder: the
        caller makes the write atomic)."""
        self.worker.save_checkpoint(directory)
        torch.save({"optim_steps": self.optim_steps}, directory / _SERVICE_STATE_FILE)

    def load_state(self, directory: Path, *, optimizer: bool) -> None:
        """The adapter of ``directory`` (saved by :meth:`save_state` on the same base, rank and
        layers; ``ValueError`` otherwise), and with ``optimizer`` the optimizer's state too, so
        the same steps continue exactly as the client that saved it. Without ``optimizer`` the
        optimizer starts afresh. Accumulated gradients are dropped either way."""
        from trainer.errors import CheckpointError

        optimizer_obj = self.worker.optimizer
        try:
            self.worker.load_checkpoint(directory)
        except CheckpointError as exc:
            raise ValueError(str(exc)) from None
        optimizer_obj.zero_grad(set_to_none=True)
        if optimizer:
            self.optim_steps = int(
                torch.load(directory / _SERVICE_STATE_FILE, weights_only=True)["optim_steps"]
            )
        else:
            optimizer_obj.state.clear()
            self.optim_steps = 0


#: What :meth:`ServiceModel.save_state` adds to the worker's checkpoint files.
_SERVICE_STATE_FILE = "service_model.pt"
