"""``algorithm.clip_cov`` and ``algorithm.kl_cov``: checked at load, naming the key, and handed
to the policy worker as the chosen loss's ``loss_options`` (verl's names)."""

from __future__ import annotations

import pytest

from trainer.algorithms import LOSS_OPTIONS
from trainer.config import load_config, loss_options
from trainer.errors import ConfigError
from trainer.run._parts import policy_kwargs


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("algorithm.clip_cov.ratio=1.5", "algorithm.clip_cov.ratio"),
        ("algorithm.kl_cov.ratio=-0.1", "algorithm.kl_cov.ratio"),
        ("algorithm.kl_cov.coef=0", "algorithm.kl_cov.coef"),
        ("algorithm.clip_cov.lb=5", "algorithm.clip_cov.lb=5 is out of range: must be below "),
    ],
)
def test_a_bad_value_is_refused_at_load_naming_its_key(override, says):
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        load_config(None, ["algorithm.policy_loss=clip_cov", override])


def test_the_defaults_are_the_losses_own_which_are_verls():
    for loss in ("clip_cov", "kl_cov"):
        cfg = load_config(None, [f"algorithm.policy_loss={loss}"])
        assert loss_options(cfg.algorithm) == LOSS_OPTIONS[loss]
    assert loss_options(load_config(None, []).algorithm) == {}  # ppo has none


@pytest.mark.parametrize(
    ("loss", "overrides", "expected"),
    [
        (
            "clip_cov",
            ["algorithm.clip_cov.ratio=0.5", "algorithm.clip_cov.lb=-1", "algorithm.clip_cov.ub=2"],
            {"clip_cov_ratio": 0.5, "clip_cov_lb": -1.0, "clip_cov_ub": 2.0},
        ),
        (
            "kl_cov",
            ["algorithm.kl_cov.ratio=0.01", "algorithm.kl_cov.coef=2"],
            {"kl_cov_ratio": 0.01, "ppo_kl_coef": 2.0},
        ),
        ("ppo", ["algorithm.kl_cov.coef=2"], {}),  # another loss's keys reach no loss
    ],
)
def test_the_chosen_losss_keys_reach_the_policy_worker(loss, overrides, expected):
    cfg = load_config(None, [f"algorithm.policy_loss={loss}", *overrides])
    assert policy_kwargs(cfg)["loss_options"] == expected
