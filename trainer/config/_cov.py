"""``algorithm.clip_cov`` and ``algorithm.kl_cov``: the parameters of the two covariance
policy losses (``algorithm.policy_loss=clip_cov`` / ``kl_cov``, :mod:`trainer.algorithms`),
verl's ``actor.policy_loss.{clip_cov_ratio, clip_cov_lb, clip_cov_ub, kl_cov_ratio}`` and
``ppo_kl_coef`` with verl's defaults; ``algorithm.dro.beta`` (``policy_loss=dro``, Tinker's);
and :func:`loss_options`, what the policy worker's loss takes of them.
docs/algorithms.md#policy-losses.
"""

from __future__ import annotations

from typing import Protocol

import attrs

from trainer.config._fields import config_field as _field
from trainer.config._fields import in_range, positive
from trainer.errors import ConfigError

__all__ = ["ClipCovConfig", "DroConfig", "KlCovConfig", "check_cov", "loss_options"]


@attrs.define
class ClipCovConfig:
    ratio: float = _field(
        0.0002,
        "policy_loss=clip_cov: the share of trained tokens whose gradient is detached, drawn "
        "among the candidates (at least one token; verl's clip_cov_ratio).",
        check=in_range(0, 1),
    )
    lb: float = _field(
        1.0,
        "policy_loss=clip_cov: a candidate's covariance (A - mean A)(logp - mean logp) is above "
        "this (verl's clip_cov_lb).",
    )
    ub: float = _field(
        5.0,
        "policy_loss=clip_cov: and below this, above lb (verl's clip_cov_ub).",
    )


@attrs.define
class KlCovConfig:
    ratio: float = _field(
        0.0002,
        "policy_loss=kl_cov: the share of trained tokens, those of largest covariance, that "
        "take the |log ratio| penalty (at least one token; verl's kl_cov_ratio).",
        check=in_range(0, 1),
    )
    coef: float = _field(
        0.1,
        "policy_loss=kl_cov: the penalty's coefficient (verl's ppo_kl_coef).",
        check=positive,
    )


@attrs.define
class DroConfig:
    beta: float = _field(
        0.05,
        "policy_loss=dro: the weight of the quadratic penalty 0.5 beta (logp - old)^2 "
        "(Tinker's loss_fn_config beta; 0.05 as Tinker's example).",
        check=positive,
    )


class _Algorithm(Protocol):
    policy_loss: str
    clip_cov: ClipCovConfig
    kl_cov: KlCovConfig
    dro: DroConfig


def check_cov(a: _Algorithm) -> None:
    """``ConfigError`` where clip_cov's covariance window is empty (``lb >= ub``)."""
    c = a.clip_cov
    if c.lb >= c.ub:
        raise ConfigError(
            f"config: algorithm.clip_cov.lb={c.lb:g} is out of range: must be below "
            f"algorithm.clip_cov.ub={c.ub:g} (no covariance lies between them)"
        )


def loss_options(a: _Algorithm) -> dict[str, float]:
    """The chosen policy loss's own parameters, by verl's (dro: Tinker's) names (empty for a
    loss with none)."""
    if a.policy_loss == "clip_cov":
        c = a.clip_cov
        return {"clip_cov_ratio": c.ratio, "clip_cov_lb": c.lb, "clip_cov_ub": c.ub}
    if a.policy_loss == "kl_cov":
        return {"kl_cov_ratio": a.kl_cov.ratio, "ppo_kl_coef": a.kl_cov.coef}
    if a.policy_loss == "dro":
        return {"beta": a.dro.beta}
    return {}
