"""KL in the reward (``algorithm.use_kl_in_reward``): each trained token's reward less ``beta``
times its KL estimate to the reference model, before the advantages, with ``beta`` fixed or
adapted to a target KL. Pure torch (the controllers plain Python).

As verl 0.9's ``apply_kl_penalty`` (``verl/trainer/ppo/ray_trainer.py``) and its
``FixedKLController`` / ``AdaptiveKLController`` (``core_algos.py``), after Ziegler et al. 2019,
"Fine-Tuning Language Models from Human Preferences" (arXiv:1909.08593, section 2.2): the KL is
the *old* policy's (the one that sampled, or the recomputed one) to the reference model's, per
token, by the estimator ``algorithm.kl_penalty``; the step's KL is the mean over the
trajectories of each one's mean over its trained tokens (a trajectory without one counts 0,
as verl's ``masked_mean``); the controller then updates once per step with
``n_steps`` = the step's trajectories.
"""

from __future__ import annotations

from typing import Any

import attrs
import numpy as np
import torch

from trainer.algorithms._ops import kl_penalty
from trainer.algorithms._registry import KL_CTRL_TYPES

__all__ = ["KlController", "kl_reward_penalty"]


@attrs.define
class KlController:
    """The coefficient ``beta`` of the KL in the reward, and how it moves.

    ``fixed``: ``beta`` never changes. ``adaptive`` (verl's ``AdaptiveKLController``, Ziegler
    et al. 2019): after each step with KL ``kl`` over ``n`` trajectories::

        e = clip(kl / target_kl - 1, -0.2, 0.2)
        beta <- beta * (1 + e * n / horizon)

    so ``beta`` grows while the KL is above the target and shrinks below it, by at most
    ``0.2 n / horizon`` a step. ``beta`` is the run's state: a checkpoint keeps it
    (:meth:`state_dict`) and a resumed run goes on from it (:meth:`load_state_dict`).
    """

    type: str
    coef: float
    target_kl: float = 0.1
    horizon: int = 10000

    def __attrs_post_init__(self) -> None:
        if self.type not in KL_CTRL_TYPES:
            raise ValueError(
                f"unknown kl_ctrl type {self.type!r}; allowed: {', '.join(KL_CTRL_TYPES)}"
            )

    def update(self, current_kl: float, n_steps: int) -> None:
        """After a step whose KL was ``current_kl`` over ``n_steps`` trajectories."""
        if self.type != "adaptive":
            return
        error = float(np.clip(current_kl / self.target_kl - 1, -0.2, 0.2))
        self.coef *= 1 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, Any]:
        return {"type": self.type, "coef": self.coef}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a checkpoint's ``beta`` (an adaptive controller's; a fixed one keeps the
        configured coefficient, which a resumed run may have changed on purpose)."""
        if self.type == "adaptive" and state.get("type") == "adaptive":
            self.coef = float(state["coef"])


def kl_reward_penalty(
    old_logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, float]:
    """``(-coef * kl_t [B, T] float64, the step's KL)``: the per-token rewards to add to the
    outcome (zero at untrained tokens) and the KL the controller reads, the mean over the
    ``B`` trajectories of each one's mean over its trained tokens. ``kl_t`` is
    :func:`trainer.algorithms.kl_penalty` of ``old_logprobs`` against ``ref_logprobs`` by
    ``estimator`` (verl's ``kl`` is ``k1``, ``mse`` ``k2``, ``low_var_kl`` ``k3``)."""
    valid = mask != 0
    kl = kl_penalty(old_logprobs.double(), ref_logprobs.double(), kind=estimator)  # type: ignore[arg-type]
    kl = torch.where(valid, kl, torch.zeros_like(kl))
    per_sequence = kl.sum(-1) / valid.sum(-1).clamp(min=1).to(kl.dtype)
    current = float(per_sequence.mean()) if per_sequence.numel() else 0.0
    return -coef * kl, current
