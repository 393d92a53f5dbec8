"""The registries: each maps the allowed values of one config key to the function that
implements each value. Torch-free: the config reads the names (its allowed values) without
importing torch; the functions are imported on first use.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal

import attrs

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "DATUM_LOSSES",
    "LOSS_AGG_MODES",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "VALUE_ESTIMATORS",
    "AdvantageEstimatorName",
    "LossAggModeName",
    "OffPolicyCorrection",
    "PolicyLossName",
    "Registry",
    "resolve_loss_agg_mode",
]

#: The off-policy corrections a policy worker applies (:mod:`trainer.off_policy`);
#: ``algorithm.off_policy_correction`` also takes ``auto``, which the run plan decides.
OffPolicyCorrection = Literal["none", "tis"]
OFF_POLICY_CORRECTIONS: tuple[OffPolicyCorrection, ...] = ("none", "tis")


@attrs.frozen
class Registry:
    """The values of config key ``key``: name -> the function of that name's algorithm (a
    function of module ``module``, named in ``functions``)."""

    key: str
    module: str
    functions: Mapping[str, str]

    @property
    def names(self) -> tuple[str, ...]:
        """The allowed values, in the registry's order (the first is the default)."""
        return tuple(self.functions)

    def get(self, name: str) -> Callable[..., Any]:
        """The function registered as ``name``; ``ValueError`` naming the allowed values for
        any other name."""
        if name not in self.functions:
            raise ValueError(f"unknown {self.key} {name!r}; allowed: {', '.join(self.names)}")
        return getattr(importlib.import_module(self.module), self.functions[name])


#: ``algorithm.advantage_estimator``: per-trajectory (or per-token) advantages from rewards.
ADVANTAGE_ESTIMATORS = Registry(
    "algorithm.advantage_estimator",
    "trainer.algorithms._advantages",
    {
        "grpo": "grpo",
        "rloo": "rloo",
        "reinforce_plus_plus": "reinforce_plus_plus",
        "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
        "grpo_passk": "grpo_passk",
        "gae": "gae",
    },
)
#: The estimators that read a critic's values: a run of one of them trains a critic
#: (``critic.*``), one without trains none.
VALUE_ESTIMATORS = frozenset({"gae"})
#: ``algorithm.policy_loss``: the per-token policy-gradient loss.
POLICY_LOSSES = Registry(
    "algorithm.policy_loss",
    "trainer.algorithms._losses",
    {"ppo": "ppo", "gspo": "gspo", "cispo": "cispo"},
)
#: The training service's losses (``python -m trainer serve``: the Tinker protocol's
#: ``loss_fn``): one datum's loss from its target tokens' logprobs, summed over its tokens.
DATUM_LOSSES = Registry(
    "loss_fn",
    "trainer.algorithms._datum_losses",
    {"cross_entropy": "cross_entropy", "importance_sampling": "importance_sampling"},
)
#: ``algorithm.loss_agg_mode``: how per-token losses become one scalar.
LOSS_AGG_MODES = Registry(
    "algorithm.loss_agg_mode",
    "trainer.algorithms._aggregation",
    {
        "token-mean": "token_mean",
        "seq-mean-token-sum": "seq_mean_token_sum",
        "seq-mean-token-mean": "seq_mean_token_mean",
        "seq-mean-token-sum-norm": "seq_mean_token_sum_norm",
    },
)

#: The aggregation a policy loss is defined with, where it has one of its own: the mode it
#: gets when ``algorithm.loss_agg_mode`` is unset, and the only one it accepts.
OWN_LOSS_AGG_MODE = {"gspo": "seq-mean-token-mean"}


def resolve_loss_agg_mode(policy_loss: str, setting: str | None) -> str:
    """The ``algorithm.loss_agg_mode`` a run of ``policy_loss`` uses: ``setting``, or when None
    the loss's own (``token-mean`` for a loss without one). ``ValueError`` for a setting the
    loss is not defined with (GSPO's objective is one term per sequence)."""
    own = OWN_LOSS_AGG_MODE.get(policy_loss)
    if setting is None:
        return own or "token-mean"
    if own is not None and setting != own:
        raise ValueError(
            f"algorithm.policy_loss={policy_loss!r} is defined with loss_agg_mode={own!r} (one "
            f"term per sequence), not {setting!r}: leave algorithm.loss_agg_mode unset"
        )
    return setting


# The config keys' types: ``Literal`` of each registry's names at run time (what the config
# loader checks a value against and the docs list); plain ``str`` for the type checker, which
# cannot read a ``Literal`` built from a tuple.
if TYPE_CHECKING:
    AdvantageEstimatorName = str
    PolicyLossName = str
    LossAggModeName = str
else:
    AdvantageEstimatorName = Literal[ADVANTAGE_ESTIMATORS.names]
    PolicyLossName = Literal[POLICY_LOSSES.names]
    LossAggModeName = Literal[LOSS_AGG_MODES.names]
