"""The ``dro`` policy loss: Direct Reward Optimisation (Richemond et al. 2024, "Offline
Regularised Reinforcement Learning for Large Language Models Alignment", arXiv:2405.19107;
the policy-mirror-descent form Kimi k1.5 trains with, Kimi Team 2025, arXiv:2501.12599), as
Tinker defines its built-in ``dro`` loss (tinker-docs, "Loss functions: DRO"). Pure torch.

Tinker's objective per token, with ``q`` the sampler's logprob of the token::

    objective_t = logp_t A_t - 0.5 beta (logp_t - q_t)^2,      loss_t = -objective_t

a policy gradient whose step away from the sampler is held back by a quadratic penalty on the
log-ratio, in place of PPO's clip: no token's gradient is ever cut off, and it works off-policy.
Here ``q`` is the old policy's logprob (the rollout's under
``algorithm.rollout_correction.bypass_mode``, which is then Tinker's sampling logprob exactly).
Tinker sums its tokens (``loss:sum``); here the run's ``algorithm.loss_agg_mode`` aggregates
(``token-sum`` gives Tinker's sum). The training service's Tinker-protocol form is another
module's (``_datum_losses``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

__all__ = ["DRO_DEFAULTS", "dro"]

#: ``beta``: the quadratic penalty's weight. Tinker's docs name no default; their example
#: passes ``loss_fn_config={"beta": 0.05}``, taken here as the default.
DRO_DEFAULTS = {"beta": 0.05}


class LossInputs(Protocol):
    """What ``dro`` reads of :class:`trainer.algorithms._losses.LossInputs` (which imports
    this module, so it is named by its shape)."""

    logprobs: torch.Tensor
    raw_log_ratio: torch.Tensor
    advantages: torch.Tensor
    valid: torch.Tensor
    options: Mapping[str, float]


def dro(x: LossInputs) -> tuple[torch.Tensor, dict[str, float]]:
    """DRO (Tinker ``dro``): ``l_t = -(logp_t A_t - 0.5 beta (logp_t - old_t)^2)``, ``beta`` the
    loss option (``algorithm.dro.beta``). The log-ratio is the raw one (no ``exp``, so no
    clamp): its gradient ``beta (logp_t - old_t)`` pulls each token back toward the old policy
    however far it went. The value includes ``logp`` (as CISPO's) and is not comparable with
    PPO's; at ``logp = old`` its gradient is REINFORCE's, ``-A grad logp``. Metric:
    ``dro_penalty``, the mean ``0.5 (logp - old)^2`` over the trained tokens (before ``beta``)."""
    beta = x.options["beta"]
    sq = x.raw_log_ratio.square()
    per_token = -(x.logprobs * x.advantages - 0.5 * beta * sq)
    n = int(x.valid.sum())
    penalty = float(0.5 * sq.detach()[x.valid].sum()) / n if n else 0.0
    return per_token, {"dro_penalty": penalty}
