"""The KL in the reward (``algorithm.use_kl_in_reward``): the run's controller, made once from
the config and a resumed checkpoint's state, and the step's token-level rewards from it.

Where the rewards live: a trajectory's outcome reward sits on its last trained token (the
advantage estimators' convention, :mod:`trainer.algorithms`); the KL penalty adds
``-beta * kl_t`` on every trained token, so a token-level estimator (``reinforce_plus_plus``,
``gae``) sees it per token and the others see the trajectory's sum, as verl's
``token_level_rewards``.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.algorithms import KlController, kl_reward_penalty
from trainer.config import Config
from trainer.workers.batch import TrainBatch

__all__ = ["KL_IN_REWARD_METRICS", "STATE_KEY", "kl_controller", "kl_token_rewards"]

#: The step's metrics (verl's ``actor/reward_kl_penalty`` and ``actor/reward_kl_penalty_coeff``):
#: the KL the controller read, and the coefficient the step's rewards were penalised with
#: (before the controller's update).
KL_IN_REWARD_METRICS = ("reward/kl_penalty", "reward/kl_coef")
#: The trainer state's key for the controller (``trainer_state.json``).
STATE_KEY = "kl_ctrl"


def kl_controller(cfg: Config, state: dict[str, Any]) -> KlController | None:
    """The run's controller (None without ``use_kl_in_reward``), at the coefficient a resumed
    checkpoint's trainer ``state`` holds (an adaptive one's) or ``kl_ctrl.kl_coef``."""
    a = cfg.algorithm
    if not a.use_kl_in_reward:
        return None
    c = a.kl_ctrl
    ctrl = KlController(c.type, c.kl_coef, target_kl=c.target_kl, horizon=c.horizon)
    if STATE_KEY in state:
        ctrl.load_state_dict(state[STATE_KEY])
    return ctrl


def kl_token_rewards(
    cfg: Config, ctrl: KlController | None, batch: TrainBatch
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The step's token-level rewards ``-beta * kl_t`` (``[B, T]``; None without the KL in the
    reward) and :data:`KL_IN_REWARD_METRICS`; the controller updates after reading the step's
    KL, over the batch's trajectories. The old logprobs are the plan's (recomputed, or the
    rollout's in bypass mode), the mask the batch's (after a rejection mask)."""
    if ctrl is None:
        return None, {}
    if batch.old_logprobs is None or batch.ref_logprobs is None:
        raise RuntimeError(
            "use_kl_in_reward needs the batch's old and reference logprobs before the "
            "advantages (the run plan recomputes the one and loads a ref worker for the other)"
        )
    coef = ctrl.coef
    penalty, kl = kl_reward_penalty(
        batch.old_logprobs, batch.ref_logprobs, batch.loss_mask, coef, cfg.algorithm.kl_penalty
    )
    ctrl.update(kl, n_steps=batch.loss_mask.shape[0])
    return penalty, {"reward/kl_penalty": kl, "reward/kl_coef": coef}
