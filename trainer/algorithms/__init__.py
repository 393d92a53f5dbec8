"""The algorithms: advantage estimators, policy losses, loss aggregation, reward shaping and the
tensor operations they share. Pure torch, no trio, no I/O.

The registries name what a run picks by config (:data:`ADVANTAGE_ESTIMATORS`,
:data:`POLICY_LOSSES`, :data:`LOSS_AGG_MODES`, and the rollout corrections :data:`ROLLOUT_IS`
and :data:`ROLLOUT_RS`): each maps a value of its config key to one
documented function, and the config's allowed values are its names. Another,
:data:`DATUM_LOSSES`, names the training service's losses (the Tinker protocol's
``loss_fn``). Importing this package
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
from trainer.algorithms._registry import DEFAULT_RS_BOUNDS as DEFAULT_RS_BOUNDS
from trainer.algorithms._registry import KL_CTRL_TYPES as KL_CTRL_TYPES
from trainer.algorithms._registry import LOSS_AGG_MODES as LOSS_AGG_MODES
from trainer.algorithms._registry import OFF_POLICY_CORRECTIONS as OFF_POLICY_CORRECTIONS
from trainer.algorithms._registry import POLICY_LOSSES as POLICY_LOSSES
from trainer.algorithms._registry import ROLLOUT_IS as ROLLOUT_IS
from trainer.algorithms._registry import ROLLOUT_RS as ROLLOUT_RS
from trainer.algorithms._registry import VALUE_ESTIMATORS as VALUE_ESTIMATORS
from trainer.algorithms._registry import AdvantageEstimatorName as AdvantageEstimatorName
from trainer.algorithms._registry import KlCtrlTypeName as KlCtrlTypeName
from trainer.algorithms._registry import LossAggModeName as LossAggModeName
from trainer.algorithms._registry import OffPolicyCorrection as OffPolicyCorrection
from trainer.algorithms._registry import PolicyLossName as PolicyLossName
from trainer.algorithms._registry import Registry as Registry
from trainer.algorithms._registry import RolloutCorrection as RolloutCorrection
from trainer.algorithms._registry import RolloutIsName as RolloutIsName
from trainer.algorithms._registry import RolloutRsName as RolloutRsName
from trainer.algorithms._registry import resolve_loss_agg_mode as resolve_loss_agg_mode

if TYPE_CHECKING:
    from trainer.algorithms._advantages import compute_advantages, gae_advantages_and_returns
    from trainer.algorithms._aggregation import BatchCounts, aggregate
    from trainer.algorithms._corrections import (
        CORRECTION_METRICS,
        importance_weights_of,
        rejection_mask_of,
    )
    from trainer.algorithms._datum_losses import DATUM_LOSS_INPUTS, datum_loss_config
    from trainer.algorithms._kl_reward import KlController, kl_reward_penalty
    from trainer.algorithms._logprobs import (
        LOGPROB_CHUNK_ELEMENTS,
        head_token_logprobs,
        head_token_logprobs_entropy,
    )
    from trainer.algorithms._losses import (
        DEFAULT_CLIP_HIGH,
        DEFAULT_CLIP_LOW,
        LOSS_OPTIONS,
        POLICY_LOSS_METRICS,
        policy_loss,
    )
    from trainer.algorithms._mismatch import (
        MISMATCH_METRICS,
        MISMATCH_SUMS,
        fold_mismatch_sums,
        mismatch_metrics,
        mismatch_sums,
    )
    from trainer.algorithms._ops import (
        KL_ESTIMATORS,
        LOG_RATIO_CLAMP,
        kl_penalty,
        masked_mean,
        masked_sum,
        token_entropy,
        token_logprobs,
    )
    from trainer.algorithms._shaping import overlong_penalty
    from trainer.algorithms._value import VALUE_LOSS_METRICS, explained_variance, value_loss

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "CORRECTION_METRICS",
    "DATUM_LOSSES",
    "DATUM_LOSS_INPUTS",
    "DEFAULT_CLIP_HIGH",
    "DEFAULT_CLIP_LOW",
    "DEFAULT_RS_BOUNDS",
    "KL_CTRL_TYPES",
    "KL_ESTIMATORS",
    "LOGPROB_CHUNK_ELEMENTS",
    "LOG_RATIO_CLAMP",
    "LOSS_AGG_MODES",
    "LOSS_OPTIONS",
    "MISMATCH_METRICS",
    "MISMATCH_SUMS",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "POLICY_LOSS_METRICS",
    "ROLLOUT_IS",
    "ROLLOUT_RS",
    "VALUE_ESTIMATORS",
    "VALUE_LOSS_METRICS",
    "AdvantageEstimatorName",
    "BatchCounts",
    "KlController",
    "KlCtrlTypeName",
    "LossAggModeName",
    "OffPolicyCorrection",
    "PolicyLossName",
    "Registry",
    "RolloutCorrection",
    "RolloutIsName",
    "RolloutRsName",
    "aggregate",
    "compute_advantages",
    "datum_loss_config",
    "explained_variance",
    "fold_mismatch_sums",
    "gae_advantages_and_returns",
    "head_token_logprobs",
    "head_token_logprobs_entropy",
    "importance_weights_of",
    "kl_penalty",
    "kl_reward_penalty",
    "masked_mean",
    "masked_sum",
    "mismatch_metrics",
    "mismatch_sums",
    "overlong_penalty",
    "policy_loss",
    "rejection_mask_of",
    "resolve_loss_agg_mode",
    "token_entropy",
    "token_logprobs",
    "value_loss",
]

#: The torch-backed names: each one's module, imported on first access.
_LAZY = {
    "compute_advantages": "_advantages",
    "gae_advantages_and_returns": "_advantages",
    "BatchCounts": "_aggregation",
    "DATUM_LOSS_INPUTS": "_datum_losses",
    "datum_loss_config": "_datum_losses",
    "aggregate": "_aggregation",
    "KlController": "_kl_reward",
    "kl_reward_penalty": "_kl_reward",
    "CORRECTION_METRICS": "_corrections",
    "importance_weights_of": "_corrections",
    "rejection_mask_of": "_corrections",
    "MISMATCH_METRICS": "_mismatch",
    "MISMATCH_SUMS": "_mismatch",
    "fold_mismatch_sums": "_mismatch",
    "mismatch_metrics": "_mismatch",
    "mismatch_sums": "_mismatch",
    "DEFAULT_CLIP_HIGH": "_losses",
    "DEFAULT_CLIP_LOW": "_losses",
    "LOSS_OPTIONS": "_losses",
    "POLICY_LOSS_METRICS": "_losses",
    "policy_loss": "_losses",
    "LOGPROB_CHUNK_ELEMENTS": "_logprobs",
    "head_token_logprobs": "_logprobs",
    "head_token_logprobs_entropy": "_logprobs",
    "KL_ESTIMATORS": "_ops",
    "LOG_RATIO_CLAMP": "_ops",
    "kl_penalty": "_ops",
    "masked_mean": "_ops",
    "masked_sum": "_ops",
    "token_entropy": "_ops",
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
