"""The Tinker protocol's built-in losses (``forward_backward(data, loss_fn)``): one datum at a
time, summed over its tokens, as the Tinker docs define them (tinker-docs "Loss Functions").

Each takes the model's log-probability of each of the datum's ``target_tokens`` (``[N]``,
differentiable) and the datum's other ``loss_fn_inputs`` as tensors aligned with it, and
returns the datum's loss, a scalar. The batch's loss is the sum of its datums' (Tinker's
``loss:sum``): no mean over tokens or datums, so gradients accumulate linearly across datums,
chunks and ``forward_backward`` calls until ``optim_step``.

What is not here yet: ``ppo``, ``cispo``, ``dro``, ``gspo`` and ``stable_reinforce`` (whose
Tinker definitions differ from this trainer's registries in their reductions, and need a check
of their own), ``custom``, and the ``[N, K]`` (top-K distillation) form of ``cross_entropy``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["DATUM_LOSS_INPUTS", "cross_entropy", "importance_sampling"]

#: The ``loss_fn_inputs`` each loss reads besides ``target_tokens``.
DATUM_LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
}


def cross_entropy(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Weighted negative log-likelihood, summed: ``-(logprobs * weights).sum()``.

    Supervised learning; ``weights`` (``[N]``, float) is typically 0 on the prompt and 1 on the
    completion. Tinker's ``cross_entropy``; verl's SFT loss with a sum in place of its mean.
    """
    return -(logprobs * inputs["weights"]).sum()


def importance_sampling(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """REINFORCE with an importance ratio, summed: ``-(exp(logprobs - q) * advantages).sum()``.

    ``q`` is ``inputs["logprobs"]``, the sampler's log-probability of each token, and
    ``advantages`` is per token (0 on the prompt). The ratio corrects for the sampler not being
    the trained policy; unclipped. Tinker's ``importance_sampling``.
    """
    ratio = torch.exp(logprobs - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()
