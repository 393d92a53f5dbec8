"""``algorithm.use_kl_in_reward``, ``algorithm.kl_penalty`` and ``algorithm.kl_ctrl``: the KL
to the reference model subtracted from each token's reward before the advantages (verl's keys,
same names and defaults: ``algorithm.kl_ctrl.{type, kl_coef, target_kl, horizon}``), checked at
load. The controller itself is :class:`trainer.algorithms.KlController`.
docs/algorithms.md#kl-in-the-reward.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from trainer.algorithms import KlCtrlTypeName
from trainer.config._fields import at_least, positive
from trainer.config._fields import config_field as _field
from trainer.errors import ConfigError

__all__ = ["KlCtrlConfig", "check_kl_in_reward"]


@attrs.define
class KlCtrlConfig:
    type: KlCtrlTypeName = _field(
        "fixed",
        "use_kl_in_reward: 'fixed' keeps kl_coef; 'adaptive' moves it toward target_kl after "
        "each step (Ziegler et al. 2019, verl's AdaptiveKLController); a checkpoint keeps it.",
    )
    kl_coef: float = _field(
        0.001,
        "use_kl_in_reward: the KL's coefficient beta in the reward (adaptive: its start).",
        check=at_least(0),
    )
    target_kl: float = _field(
        0.1,
        "type=adaptive: the KL per token (mean over trajectories) the coefficient steers to.",
        check=positive,
    )
    horizon: int = _field(
        10000,
        "type=adaptive: the trajectories over which the coefficient moves by at most 20% "
        "(each step: beta *= 1 + clip(kl / target_kl - 1, -0.2, 0.2) * trajectories / horizon).",
        check=at_least(1),
    )


class _Algorithm(Protocol):
    use_kl_in_reward: bool
    use_kl_loss: bool


def check_kl_in_reward(a: _Algorithm) -> None:
    """``ConfigError`` for ``use_kl_in_reward`` with ``use_kl_loss``: the same KL to the same
    reference model twice, through two coefficients (SkyRL refuses the pair; verl warns)."""
    if a.use_kl_in_reward and a.use_kl_loss:
        raise ConfigError(
            "config: algorithm.use_kl_in_reward=true and algorithm.use_kl_loss=true penalise "
            "the same KL twice (in the reward and in the loss): choose one"
        )
