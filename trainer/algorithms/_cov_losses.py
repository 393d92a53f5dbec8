"""The covariance-guided policy losses of Cui et al. 2025, "The Entropy Mechanism of
Reinforcement Learning for Reasoning Language Models" (arXiv:2505.22617): ``clip_cov`` and
``kl_cov``, as verl 0.9.1 defines them (``compute_policy_loss_clip_cov``,
``compute_policy_loss_kl_cov`` in ``verl/trainer/ppo/core_algos.py``). Pure torch.

The paper finds the policy's entropy falls with the covariance between a token's log-prob and
its advantage, and that a small share of tokens with the largest covariance drives the
collapse; both losses act on those tokens only. The covariance of a token is
``(A_t - mean A) (logp_t - mean logp)``, the means over the call's trained tokens (a
micro-batch's, as verl's are) and detached.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

__all__ = ["CLIP_COV_DEFAULTS", "KL_COV_DEFAULTS", "clip_cov", "kl_cov", "token_covariance"]

#: verl's defaults (``actor.policy_loss.clip_cov_ratio``, ``clip_cov_lb``, ``clip_cov_ub``).
CLIP_COV_DEFAULTS = {"clip_cov_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0}
#: verl's defaults (``actor.policy_loss.kl_cov_ratio``, ``ppo_kl_coef`` of its config).
KL_COV_DEFAULTS = {"kl_cov_ratio": 0.0002, "ppo_kl_coef": 0.1}


class LossInputs(Protocol):
    """What these losses read of :class:`trainer.algorithms._losses.LossInputs` (which imports
    this module, so it is named by its shape)."""

    logprobs: torch.Tensor
    log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    clip_low: float
    clip_high: float
    options: Mapping[str, float]

    @property
    def ratio(self) -> torch.Tensor: ...
    def frac(self, flags: torch.Tensor) -> float: ...


def token_covariance(x: LossInputs) -> torch.Tensor:
    """``[B, T]``: each trained token's ``(A_t - mean A) (logp_t - mean logp)``, means over the
    trained tokens, detached; ``-inf`` at masked positions (never selected)."""
    n = x.valid.sum().clamp(min=1)
    adv = x.advantages.detach()
    logp = x.logprobs.detach()
    cov = (adv - adv[x.valid].sum() / n) * (logp - logp[x.valid].sum() / n)
    return torch.where(x.valid, cov, torch.full_like(cov, float("-inf")))


def clip_cov(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """Clip-Cov (verl ``clip_cov``): PPO-clip, and the gradient of a few high-covariance tokens
    detached. Of the trained tokens PPO's clip leaves alone, those whose covariance lies in
    ``(clip_cov_lb, clip_cov_ub)`` are candidates; ``max(1, int(clip_cov_ratio * N))`` of them
    (``N`` trained tokens), drawn at random (``torch.randperm``, the global generator, as
    verl), lose their term::

        l_t = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)) * c_t,  c_t = 0 if drawn else 1

    Metrics: ``clip_frac`` (PPO's clip, as ``ppo``), ``cov_clip_frac`` (the share drawn: verl's
    ``pg_clipfrac`` for this loss), ``cov_candidates_frac``."""
    o = x.options
    ratio, adv = x.ratio, x.advantages
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - x.clip_low, 1.0 + x.clip_high)
    by_ppo = (clipped > unclipped) & x.valid
    cov = token_covariance(x)
    candidates = x.valid & ~by_ppo & (cov > o["clip_cov_lb"]) & (cov < o["clip_cov_ub"])
    where = torch.nonzero(candidates)
    n_clip = max(int(o["clip_cov_ratio"] * int(x.valid.sum())), 1)
    drawn = where[torch.randperm(len(where), device=where.device)[:n_clip]]
    keep = torch.ones_like(ratio)
    keep[drawn[:, 0], drawn[:, 1]] = 0.0
    per_token = torch.maximum(unclipped, clipped) * keep
    return per_token, {
        "clip_frac": x.frac(by_ppo),
        "cov_clip_frac": x.frac(keep == 0),
        "cov_candidates_frac": x.frac(candidates),
    }


def kl_cov(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-Cov (verl ``kl_cov``): the unclipped policy-gradient term, and on the
    ``max(1, int(kl_cov_ratio * N))`` trained tokens of largest covariance a penalty on the
    absolute log-ratio::

        l_t = -A r                                  (most tokens)
        l_t = -A r + ppo_kl_coef |logp_t - old_t|   (the top tokens by covariance)

    No clip range applies (as verl). Metrics: ``kl_cov_frac`` (the share penalised),
    ``abs_kl`` (the mean ``|logp - old|``: verl's ``ppo_kl`` for this loss)."""
    o = x.options
    ratio, adv = x.ratio, x.advantages
    per_token = -adv * ratio
    penalised = torch.zeros_like(x.valid)
    n_valid = int(x.valid.sum())
    if n_valid:
        k = max(1, int(n_valid * o["kl_cov_ratio"]))
        top = torch.topk(token_covariance(x).flatten(), k, largest=True).indices
        penalised.view(-1)[top] = True
        penalised &= x.valid
    per_token = torch.where(penalised, per_token + o["ppo_kl_coef"] * x.log_ratio.abs(), per_token)
    abs_kl = float(x.log_ratio.detach().abs()[x.valid].mean()) if n_valid else 0.0
    return per_token, {"kl_cov_frac": x.frac(penalised), "abs_kl": abs_kl}
