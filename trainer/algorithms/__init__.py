"""The algorithms: advantage estimators, policy losses, loss aggregation, reward shaping and the
tensor operations they share. Pure torch, no trio, no I/O.

Three registries name what a run picks by config (:data:`ADVANTAGE_ESTIMATORS`,
:data:`POLICY_LOSSES`, :data:`LOSS_AGG_MODES`): each maps a value of its config key to one
documented function, and the config's allowed values are its names. A fourth,
:data:`DATUM_LOSSES`, names the training service's losses (the Tinker protocol's ``loss_fn``). Importing this package
does not import torch (the config reads the names); the functions below are imported on first
use.

Shapes: ``B`` trajectories, ``T`` response tokens per trajectory (padded), ``V`` vocabulary
size; ``mask`` ``[B, T]`` marks the trained tokens (see :mod:`trainer.algorithms._ops`).

Usage in a step::

    adv = compute_advantages(rewards, group_ids, "grpo", mask=mask)       # [B] or [B, T]
    logp = token_logprobs(logits, response_ids, temperature)              # [B, T]
    logp = head_token_logprobs(hidden, lm_head.weight, ids, temperature)  # [N], chunked
    counts = BatchCounts.of(mini_batch_mask)                              # once per mini-batch
    loss, metrics = policy_loss(logp, old_logp, adv, mask, loss="ppo", counts=counts)
    if kl_coef:
        loss = loss + kl_coef * aggregate(kl_penalty(logp, ref_logp), mask, counts=counts)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from trainer.algorithms._registry import ADVANTAGE_ESTIMATORS as ADVANTAGE_ESTIMATORS
from trainer.algorithms._registry import DATUM_LOSSES as DATUM_LOSSES
from trainer.algorithms._registry import LOSS_AGG_MODES as LOSS_AGG_MODES
from trainer.algorithms._registry import OFF_POLICY_CORRECTIONS as OFF_POLICY_CORRECTIONS
from trainer.algorithms._registry import POLICY_LOSSES as POLICY_LOSSES
from trainer.algorithms._registry import VALUE_ESTIMATORS as VALUE_ESTIMATORS
from trainer.algorithms._registry import AdvantageEstimatorName as AdvantageEstimatorName
from trainer.algorithms._registry import LossAggModeName as LossAggModeName
from trainer.algorithms._registry import OffPolicyCorrection as OffPolicyCorrection
from trainer.algorithms._registry import PolicyLossName as PolicyLossName
from trainer.algorithms._registry import Registry as Registry
from trainer.algorithms._registry import resolve_loss_agg_mode as resolve_loss_agg_mode

if TYPE_CHECKING:
    from trainer.algorithms._advantages import compute_advantages, gae_advantages_and_returns
    from trainer.algorithms._aggregation import BatchCounts, aggregate
    from trainer.algorithms._datum_losses import DATUM_LOSS_INPUTS
    from trainer.algorithms._logprobs import LOGPROB_CHUNK_ELEMENTS, head_token_logprobs
    from trainer.algorithms._losses import (
        DEFAULT_CLIP_HIGH,
        DEFAULT_CLIP_LOW,
        POLICY_LOSS_METRICS,
        policy_loss,
    )
    from trainer.algorithms._ops import (
        KL_ESTIMATORS,
        LOG_RATIO_CLAMP,
        kl_penalty,
        masked_mean,
        masked_sum,
        token_logprobs,
    )
    from trainer.algorithms._shaping import overlong_penalty
    from trainer.algorithms._value import VALUE_LOSS_METRICS, explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DATUM_LOSSES",
    "DATUM_LOSS_INPUTS",
    "DEFAULT_CLIP_HIGH",
    "DEFAULT_CLIP_LOW",
    "KL_ESTIMATORS",
    "LOGPROB_CHUNK_ELEMENTS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "POLICY_LOSS_METRICS",
    "VALUE_ESTIMATORS",
    "VALUE_LOSS_METRICS",
    "AdvantageEstimatorName",
    "BatchCounts",
    "LossAggModeName",
    "OffPolicyCorrection",
    "PolicyLossName",
    "Registry",
    "aggregate",
    "compute_advantages",
    "explained_variance",
    "gae_advantages_and_returns",
    "head_token_logprobs",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "overlong_penalty",
    "policy_loss",
    "resolve_loss_agg_mode",
    "token_logprobs",
    "value_loss",
]

#: The torch-backed names: each one's module, imported on first access.
_LAZY = {
    "compute_advantages": "_advantages",
    "gae_advantages_and_returns": "_advantages",
    "BatchCounts": "_aggregation",
    "DATUM_LOSS_INPUTS": "_datum_losses",
    "aggregate": "_aggregation",
    "DEFAULT_CLIP_HIGH": "_losses",
    "DEFAULT_CLIP_LOW": "_losses",
    "POLICY_LOSS_METRICS": "_losses",
    "policy_loss": "_losses",
    "LOGPROB_CHUNK_ELEMENTS": "_logprobs",
    "head_token_logprobs": "_logprobs",
    "KL_ESTIMATORS": "_ops",
    "LOG_RATIO_CLAMP": "_ops",
    "kl_penalty": "_ops",
    "masked_mean": "_ops",
    "masked_sum": "_ops",
    "token_logprobs": "_ops",
    "overlong_penalty": "_shaping",
    "VALUE_LOSS_METRICS": "_value",
    "explained_variance": "_value",
    "value_loss": "_value",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer.algorithms' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"trainer.algorithms.{module}"), name)
    globals()[name] = value
    return value
