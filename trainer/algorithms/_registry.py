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
    "DEFAULT_RS_BOUNDS",
    "KL_CTRL_TYPES",
    "LOSS_AGG_MODES",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "ROLLOUT_IS",
    "ROLLOUT_RS",
    "VALUE_ESTIMATORS",
    "AdvantageEstimatorName",
    "KlCtrlTypeName",
    "LossAggModeName",
    "OffPolicyCorrection",
    "PolicyLossName",
    "Registry",
    "RolloutCorrection",
    "RolloutIsName",
    "RolloutRsName",
    "resolve_loss_agg_mode",
]

#: The off-policy corrections a policy worker applies (:mod:`trainer.off_policy`);
#: ``algorithm.off_policy_correction`` also takes ``auto``, which the run plan decides.
OffPolicyCorrection = Literal["none", "tis"]
OFF_POLICY_CORRECTIONS: tuple[OffPolicyCorrection, ...] = ("none", "tis")
#: ``algorithm.kl_ctrl.type``: how the KL in the reward's coefficient moves
#: (:class:`trainer.algorithms.KlController`).
KL_CTRL_TYPES: tuple[str, ...] = ("fixed", "adaptive")


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
    {
        "ppo": "ppo",
        "gspo": "gspo",
        "cispo": "cispo",
        "clip_cov": "clip_cov",
        "kl_cov": "kl_cov",
        "dro": "dro",
    },
)
#: The training service's losses (``python -m trainer serve``: the Tinker protocol's
#: ``loss_fn``): one datum's loss from its target tokens' logprobs, summed over its tokens.
DATUM_LOSSES = Registry(
    "loss_fn",
    "trainer.algorithms._datum_losses",
    {
        "cross_entropy": "cross_entropy",
        "importance_sampling": "importance_sampling",
        "ppo": "ppo",
        "cispo": "cispo",
        "dro": "dro",
        "gspo": "gspo",
    },
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
        "token-sum": "token_sum",
    },
)

#: ``algorithm.rollout_correction.rollout_is``: importance weights of the rollout's tokens,
#: each a function of the old-over-rollout log-ratio, the trained tokens and the cap.
ROLLOUT_IS = Registry(
    "algorithm.rollout_correction.rollout_is",
    "trainer.algorithms._corrections",
    {"token": "token_is", "sequence": "sequence_is"},
)
#: ``algorithm.rollout_correction.rollout_rs``: rejection masks of the rollout's tokens, each a
#: function of the log-ratio, the trained tokens and the bounds on its ratio.
ROLLOUT_RS = Registry(
    "algorithm.rollout_correction.rollout_rs",
    "trainer.algorithms._corrections",
    {
        "token": "token_rs",
        "sequence": "sequence_rs",
        "geometric": "geometric_rs",
        "icepop": "icepop_rs",
    },
)

#: Each mask's bounds ``(lower, upper)`` on its ratio when ``rollout_rs_threshold`` (and
#: ``_lower``) are unset: the geometric mask's are SkyRL's ``[0.99, 1.01]``; IcePop's ``b`` is 2.
DEFAULT_RS_BOUNDS: dict[str, tuple[float, float]] = {
    "token": (0.5, 2.0),
    "sequence": (0.5, 2.0),
    "geometric": (0.99, 1.01),
    "icepop": (0.5, 2.0),
}


@attrs.frozen
class RolloutCorrection:
    """What the run corrects, decided once by the run plan from ``algorithm.rollout_correction``
    (and the older ``algorithm.off_policy_correction``/``tis_cap``)."""

    #: ``rollout_is``: None, ``token`` or ``sequence`` importance weights.
    rollout_is: str | None = None
    #: Their truncation (``rollout_is_threshold``); None: untruncated.
    rollout_is_threshold: float | None = 2.0
    #: ``rollout_rs``: None, ``token``, ``sequence``, ``geometric`` or ``icepop``.
    rollout_rs: str | None = None
    #: The mask's bounds on its ratio: kept where ``lower <= ratio <= upper``.
    rs_lower: float = 0.5
    rs_upper: float = 2.0
    #: The rollout's logprobs are the old policy's (no recompute): the PPO ratio itself is
    #: taken against the sampler.
    bypass_mode: bool = False

    @property
    def needs_rollout_logprobs(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None or self.bypass_mode


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
    RolloutIsName = str
    RolloutRsName = str
    KlCtrlTypeName = str
else:
    AdvantageEstimatorName = Literal[ADVANTAGE_ESTIMATORS.names]
    PolicyLossName = Literal[POLICY_LOSSES.names]
    LossAggModeName = Literal[LOSS_AGG_MODES.names]
    RolloutIsName = Literal[ROLLOUT_IS.names]
    RolloutRsName = Literal[ROLLOUT_RS.names]
    KlCtrlTypeName = Literal[KL_CTRL_TYPES]
