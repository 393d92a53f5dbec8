"""Mismatch diagnostics: how far the sampler's probabilities of the sampled tokens are from the
trainer's, every step (the ``mismatch/*`` metrics). Pure torch.

Four numbers over a step's trained tokens, from the engine's logprobs ``q_t`` (the rollout's)
and the trainer's ``p_t`` (the old policy's, before the update):

- ``logprob_abs_diff_mean`` and ``logprob_abs_diff_max``: the mean and max of ``|p_t - q_t|``
  (in log space);
- ``prob_pearson``: Pearson's correlation of the probabilities ``exp(p_t)`` and ``exp(q_t)``
  (verl's ``training/rollout_actor_probs_pearson_corr``; MiniMax-M1, arXiv:2506.13585, found
  a training-inference mismatch by it);
- ``is_ess``: the normalized effective sample size of the untruncated importance weights
  ``w_t = exp(p_t - q_t)``, ``(sum w)^2 / (n sum w^2)`` in ``(0, 1]`` (1: every weight equal;
  ``1/n``: one token carries them all). verl's ``rollout_is_eff_sample_size`` is the same
  quantity of the *truncated* weights; the untruncated ones say how far apart the two
  policies are whatever correction the run applies.

A step's tokens are scored in parts (micro-batches, data-parallel ranks, mini-batches), so the
numbers are made exactly from sums that add up across parts (:func:`mismatch_sums`, keys
:data:`MISMATCH_SUMS`: every one sums but ``*_max``, which folds by max), and turned into the
metrics once, over the step (:func:`mismatch_metrics`). Sums are in float64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from trainer.algorithms._ops import LOG_RATIO_CLAMP

__all__ = [
    "MISMATCH_METRICS",
    "MISMATCH_SUMS",
    "fold_mismatch_sums",
    "mismatch_metrics",
    "mismatch_sums",
]

#: The diagnostics, each reported as ``mismatch/<name>``.
MISMATCH_METRICS: tuple[str, ...] = (
    "logprob_abs_diff_mean",
    "logprob_abs_diff_max",
    "prob_pearson",
    "is_ess",
)
_S = "mismatch_sums/"
#: The sufficient statistics of a part of the step's tokens: the count ``n``; ``sum |p - q|``
#: and its max; the sums of the probabilities, their squares and products (Pearson's); the sums
#: of the weights and of their squares (the ESS).
MISMATCH_SUMS: tuple[str, ...] = tuple(
    _S + k for k in ("n", "abs_diff", "abs_diff_max", "p", "q", "pp", "qq", "pq", "w", "ww")
)


@torch.no_grad()
def mismatch_sums(
    trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """The :data:`MISMATCH_SUMS` over the trained tokens (``mask != 0``) of ``[B, T]`` logprobs:
    the trainer's ``p`` and the rollout's ``q``. Add the sums of two parts (max for the
    ``*_max``) and they are the sums of both."""
    valid = mask.to(device=trainer_logprobs.device) != 0
    p_log = trainer_logprobs.detach().double()[valid]
    q_log = rollout_logprobs.to(trainer_logprobs.device).double()[valid]
    diff = p_log - q_log
    p, q = torch.exp(p_log), torch.exp(q_log)
    w = torch.exp(diff.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    values = {
        "n": float(valid.sum()),
        "abs_diff": float(diff.abs().sum()),
        "abs_diff_max": float(diff.abs().max()) if diff.numel() else 0.0,
        "p": float(p.sum()),
        "q": float(q.sum()),
        "pp": float((p * p).sum()),
        "qq": float((q * q).sum()),
        "pq": float((p * q).sum()),
        "w": float(w.sum()),
        "ww": float((w * w).sum()),
    }
    return {_S + k: v for k, v in values.items()}


def mismatch_metrics(sums: Mapping[str, float]) -> dict[str, float]:
    """The :data:`MISMATCH_METRICS` (named ``mismatch/<name>``) of a step's summed
    :data:`MISMATCH_SUMS`. Empty with no trained token; ``prob_pearson`` is left out where it is
    undefined (fewer than two tokens, or one side's probabilities all equal)."""
    s = {k.removeprefix(_S): float(v) for k, v in sums.items() if k.startswith(_S)}
    n = s.get("n", 0.0)
    if n < 1:
        return {}
    out = {
        "mismatch/logprob_abs_diff_mean": s["abs_diff"] / n,
        "mismatch/logprob_abs_diff_max": s["abs_diff_max"],
        "mismatch/is_ess": s["w"] ** 2 / (n * s["ww"]) if s["ww"] > 0 else 1.0,
    }
    cov = s["pq"] - s["p"] * s["q"] / n
    var_p = s["pp"] - s["p"] ** 2 / n
    var_q = s["qq"] - s["q"] ** 2 / n
    if n >= 2 and var_p > 0 and var_q > 0:
        out["mismatch/prob_pearson"] = max(-1.0, min(1.0, cov / math.sqrt(var_p * var_q)))
    return out


def fold_mismatch_sums(totals: dict[str, float], sums: Mapping[str, float]) -> None:
    """Add one part's ``sums`` into ``totals`` (max for ``*_max``)."""
    for k, v in sums.items():
        if k.endswith("_max"):
            totals[k] = max(totals.get(k, v), v)
        else:
            totals[k] = totals.get(k, 0.0) + v
