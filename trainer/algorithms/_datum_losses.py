"""The Tinker protocol's built-in losses (``forward_backward(data, loss_fn, loss_fn_config)``):
one datum at a time, summed over its tokens, as the Tinker docs define them (tinker-docs
"Loss Functions": ``cross_entropy``, ``importance_sampling``, ``ppo``, ``cispo``, ``dro``,
``gspo``).

Each takes the model's log-probability of each of the datum's ``target_tokens`` (``[N]``,
differentiable), the datum's other ``loss_fn_inputs`` as tensors aligned with it, and the
call's ``loss_fn_config`` as keywords (checked first by :func:`datum_loss_config`), and returns
the datum's loss, a scalar. The batch's loss is the sum of its datums' (Tinker's ``loss:sum``):
no mean over tokens or datums, so gradients accumulate linearly across datums, chunks and
``forward_backward`` calls until ``optim_step``.

The policy-gradient losses take ``logprobs`` (the sampler's, ``q``) and ``advantages``; their
ratio is ``exp(logprobs - q)``. This trainer's own ``algorithm.policy_loss`` registry
(:mod:`trainer.algorithms._losses`) has losses of the same names with other reductions (a
token mean, verl's dual clip): these are the Tinker definitions, kept apart.

What is not here: ``stable_reinforce`` (the Tinker docs read for this service do not define it;
refused rather than guessed), ``custom`` as a server-side loss (the SDK's
``forward_backward_custom`` with a Python function needs none: it runs a ``forward`` and a
``cross_entropy`` surrogate with ``weights = -dC/dlogprobs``, both served), and the
``[N, K]`` (top-K distillation) form of ``cross_entropy``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

__all__ = [
    "DATUM_LOSS_CONFIG",
    "DATUM_LOSS_INPUTS",
    "cispo",
    "cross_entropy",
    "datum_loss_config",
    "dro",
    "gspo",
    "importance_sampling",
    "ppo",
]

#: The ``loss_fn_inputs`` each loss reads besides ``target_tokens``.
DATUM_LOSS_INPUTS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
    "dro": ("logprobs", "advantages"),
    "gspo": ("logprobs", "advantages", "sequence_ratio_mask"),
}

#: The ``loss_fn_config`` keys each loss takes, with their defaults (None: required). ppo's
#: and cispo's are the Tinker docs' (ppo: 0.2 either side of 1; cispo: the one-sided 0 and 4);
#: the docs state no default for dro's ``beta`` (so it is required) nor gspo's thresholds
#: (ppo's here).
DATUM_LOSS_CONFIG: dict[str, dict[str, float | None]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": None},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}


def datum_loss_config(loss_fn: str, given: Mapping[str, float | str] | None) -> dict[str, float]:
    """``loss_fn``'s keywords from the call's ``loss_fn_config``: the defaults filled in, each
    value checked. ``ValueError`` in one sentence naming the key otherwise (the client's
    error)."""
    allowed = DATUM_LOSS_CONFIG[loss_fn]
    given = dict(given or {})
    unknown = sorted(set(given) - set(allowed))
    if unknown:
        takes = f"takes {sorted(allowed)}" if allowed else "takes none"
        raise ValueError(f"loss_fn_config {unknown} is not a key of {loss_fn} ({takes})")
    out: dict[str, float] = {}
    for key, default in allowed.items():
        value = given.get(key, default)
        if value is None:
            raise ValueError(f"{loss_fn} needs loss_fn_config[{key!r}] (a number; no default)")
        if isinstance(value, str) or not math.isfinite(float(value)):
            raise ValueError(f"loss_fn_config[{key!r}] must be a finite number, not {value!r}")
        out[key] = float(value)
    if "clip_low_threshold" in out:
        low, high = out["clip_low_threshold"], out["clip_high_threshold"]
        if not 0 <= low <= high:
            raise ValueError(
                f"{loss_fn}: loss_fn_config needs 0 <= clip_low_threshold <= "
                f"clip_high_threshold, not {low:g} and {high:g}"
            )
    if out.get("beta", 0.0) < 0:
        raise ValueError(f"dro: loss_fn_config['beta'] must be >= 0, not {out['beta']:g}")
    return out


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


def ppo(
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """PPO's clipped objective, token by token, summed:
    ``-min(r * A, clamp(r, low, high) * A).sum()`` with ``r = exp(logprobs - q)``.

    A token whose clipped term is the minimum contributes no gradient. Tinker's ``ppo``
    (thresholds are ratios, not epsilons: 0.8 and 1.2 by default).
    """
    ratio = torch.exp(logprobs - inputs["logprobs"])
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -torch.min(ratio * adv, clipped * adv).sum()


def cispo(
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    clip_low_threshold: float = 0.0,
    clip_high_threshold: float = 4.0,
) -> torch.Tensor:
    """CISPO, summed: ``-(sg[clamp(r, low, high)] * logprobs * A).sum()``.

    The clipped ratio is a detached coefficient on the log-probability: no token's gradient is
    ever zeroed, only bounded. Tinker's ``cispo`` (one-sided by default: 0 and 4).
    """
    ratio = torch.exp(logprobs - inputs["logprobs"])
    coef = torch.clamp(ratio, clip_low_threshold, clip_high_threshold).detach()
    return -(coef * logprobs * inputs["advantages"]).sum()


def dro(logprobs: torch.Tensor, inputs: Mapping[str, torch.Tensor], *, beta: float) -> torch.Tensor:
    """DRO, summed: ``-(logprobs * A - beta / 2 * (logprobs - q) ** 2).sum()``.

    The quadratic penalty keeps the learner near the sampler; the (soft) advantages are the
    client's. Tinker's ``dro``; ``beta`` has no default.
    """
    penalty = (logprobs - inputs["logprobs"]) ** 2
    return -(logprobs * inputs["advantages"] - 0.5 * beta * penalty).sum()


def gspo(
    logprobs: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    *,
    clip_low_threshold: float = 0.8,
    clip_high_threshold: float = 1.2,
) -> torch.Tensor:
    """GSPO-token, summed: PPO's clipped objective on ``s_t = sg[s] * p_t / sg[p_t]``, where
    ``s = exp(mean over the masked tokens of (logprobs - q))`` (the masked tokens: those where
    ``sequence_ratio_mask`` is nonzero).

    Every token carries the sequence ratio's value and its own log-probability's gradient.
    Tinker's ``gspo``. ``ValueError`` for a datum whose mask marks no token.
    """
    in_ratio = inputs["sequence_ratio_mask"] != 0
    if not bool(in_ratio.any()):
        raise ValueError("gspo: a datum's sequence_ratio_mask marks no token")
    log_ratio = (logprobs.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(log_ratio + logprobs - logprobs.detach())
    adv = inputs["advantages"]
    clipped = torch.clamp(ratio, clip_low_threshold, clip_high_threshold)
    return -torch.min(ratio * adv, clipped * adv).sum()
