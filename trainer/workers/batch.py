"""The padded tensor batch that workers train on (``trainer.loop._stages.make_batch`` builds it)."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from trainer.algorithms import BatchCounts

__all__ = ["TrainBatch"]


@attrs.define
class TrainBatch:
    """Right-padded ``prompt + response`` sequences; token-level tensors align with predictions.

    ``loss_mask[b, t]`` is 1 where position ``t`` predicts a trained (model-generated)
    response token ``input_ids[b, t + 1]``; logprob tensors share that ``[B, L - 1]`` shape.
    The batch is pickled whole to Ray actors (``select`` gives each rank its rows), so every
    field here travels with it.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    #: Advantages, per trajectory ``[B]`` or per token ``[B, L - 1]`` like ``loss_mask``
    #: (set after compute_advantages).
    advantages: torch.Tensor | None = None
    #: The trained policy's logprobs before the update ``[B, L - 1]`` (recomputed by the worker).
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    #: The engine's logprob of each sampled token when it was sampled ``[B, L - 1]``, aligned
    #: like ``old_logprobs``; ``0.0`` where ``loss_mask`` is 0 (the off-policy correction's
    #: behaviour policy).
    rollout_logprobs: torch.Tensor | None = None
    #: The critic's value of each position when the batch was scored ``[B, L - 1]`` (a run
    #: with a critic: ``algorithm.advantage_estimator=gae``), aligned like ``loss_mask``.
    values: torch.Tensor | None = None
    #: The critic's targets, GAE's returns ``[B, L - 1]`` (0 where ``loss_mask`` is 0).
    returns: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask.sum())

    @property
    def lengths(self) -> list[int]:
        """Each row's length: one past its last attended position (its padding cut off)."""
        positions = torch.arange(1, self.input_ids.shape[1] + 1)
        attended = self.attention_mask.cpu() != 0
        return torch.where(attended, positions, 0).amax(dim=1).tolist()

    @property
    def counts(self) -> BatchCounts:
        """This batch's trained tokens and sequences: what a loss over it is normalized by
        (pass a mini-batch's to every micro-batch and rank that trains a part of it)."""
        return BatchCounts.of(self.loss_mask)

    def to(self, device: torch.device) -> TrainBatch:
        """This batch with every tensor that is set on ``device`` (itself when already there)."""
        if self.input_ids.device == device:
            return self
        return attrs.evolve(
            self,
            **{
                f.name: None if (t := getattr(self, f.name)) is None else t.to(device)
                for f in attrs.fields(TrainBatch)
            },
        )

    def select(self, index: Sequence[int] | slice) -> TrainBatch:
        """The rows ``index`` (tensors that are set are sliced alike)."""
        idx = index if isinstance(index, slice) else torch.as_tensor(list(index), dtype=torch.long)

        def take(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[idx]

        rows = {f.name: take(getattr(self, f.name)) for f in attrs.fields(TrainBatch)}
        return TrainBatch(**rows)  # type: ignore[arg-type]  # the required three are set

    def trimmed(self) -> TrainBatch:
        """This batch padded only to its longest row: the columns past every row's length cut
        off (itself when there are none). A causal model's outputs at the kept positions do
        not depend on the cut ones, so logprobs, losses and gradients are the same, less the
        padding's compute. Per-token tensors ``[B, L - 1]`` are cut alike; ``[B]`` ones kept."""
        width = max(self.lengths, default=0)
        full = self.input_ids.shape[1]
        if width >= full:
            return self
        tokens = {"input_ids", "attention_mask"}

        def cut(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.dim() < 2:
                return t
            return t[:, :width] if name in tokens else t[:, : max(width - 1, 0)]

        cols = {f.name: cut(f.name, getattr(self, f.name)) for f in attrs.fields(TrainBatch)}
        return TrainBatch(**cols)  # type: ignore[arg-type]  # the required three are set
