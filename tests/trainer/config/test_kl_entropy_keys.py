"""``algorithm.use_kl_in_reward``, ``kl_penalty``, ``kl_ctrl.*`` and ``entropy_coeff``: checked
at load naming the key, the pair with ``use_kl_loss`` refused in one line, and what the run
plan decides of them (the old logprobs read before the advantages, a reference model)."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.run._parts import policy_kwargs

KL = "algorithm.use_kl_in_reward=true"


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("algorithm.kl_ctrl.kl_coef=-1", "algorithm.kl_ctrl.kl_coef"),
        ("algorithm.kl_ctrl.target_kl=0", "algorithm.kl_ctrl.target_kl"),
        ("algorithm.kl_ctrl.horizon=0", "algorithm.kl_ctrl.horizon"),
        ("algorithm.kl_ctrl.type=pid", "algorithm.kl_ctrl.type"),
        ("algorithm.kl_penalty=low_var_kl", "algorithm.kl_penalty"),
        ("algorithm.entropy_coeff=-0.01", "algorithm.entropy_coeff"),
    ],
)
def test_a_bad_value_is_refused_at_load_naming_its_key(override, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        load_config(None, [KL, override])


def test_kl_in_the_reward_with_the_kl_loss_is_refused_in_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(None, [KL, "algorithm.use_kl_loss=true"])
    assert "\n" not in str(e.value)
    assert "use_kl_in_reward=true and algorithm.use_kl_loss=true" in str(e.value)


def test_the_plan_reads_the_old_logprobs_before_the_advantages_and_runs_a_reference_model():
    plain = load_config(None, []).plan
    assert not plain.kl_in_reward and not plain.uses_reference_model
    assert not plain.recomputes_old_logprobs  # one update per batch: the update's forward
    plan = load_config(None, [KL]).plan
    assert plan.kl_in_reward and plan.uses_reference_model and plan.recomputes_old_logprobs
    bypass = load_config(None, [KL, "algorithm.rollout_correction.bypass_mode=true"]).plan
    assert not bypass.recomputes_old_logprobs  # the rollout's are the old policy's
    assert load_config(None, ["algorithm.use_kl_loss=true"]).plan.uses_reference_model


def test_the_entropy_coefficient_reaches_the_policy_worker():
    assert policy_kwargs(load_config(None, []))["entropy_coeff"] == 0.0
    assert (
        policy_kwargs(load_config(None, ["algorithm.entropy_coeff=0.01"]))["entropy_coeff"] == 0.01
    )


def test_verls_names_of_the_estimator_are_answered_with_ours():
    with pytest.raises(
        ConfigError, match=r"'low_var_kl' is verl's value: write algorithm\.kl_penalty=k3"
    ):
        load_config(None, [KL, "algorithm.kl_penalty=low_var_kl"])
    assert load_config(None, [KL, "algorithm.kl_penalty=k3"]).algorithm.kl_penalty == "k3"
