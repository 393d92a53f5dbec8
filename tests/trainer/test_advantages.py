"""The advantage estimators beyond GRPO and RLOO (REINFORCE++, its group baseline, pass@k)
against values worked out by hand, and the registry that names them."""

from __future__ import annotations

import inspect
import math
import sys
import typing

import pytest
import torch

from trainer.algorithms import ADVANTAGE_ESTIMATORS, compute_advantages
from trainer.config import load_config
from trainer.config._schema import AlgorithmConfig
from trainer.errors import ConfigError

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def lengths_mask(lengths: list[int], width: int) -> torch.Tensor:
    return torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]


def test_reinforce_plus_plus_whitens_the_returns_over_the_batchs_tokens():
    # rewards [1, 0]; row 0 has 3 trained tokens, row 1 one. gamma 1: returns 1, 1, 1 | 0.
    # Over the 4 tokens: mean 3/4, unbiased var (3 * (1/4)^2 + (3/4)^2) / 3 = 1/4, std 1/2:
    # row 0's tokens (1 - 3/4) / (1/2) = 1/2, row 1's (0 - 3/4) / (1/2) = -3/2.
    mask = lengths_mask([3, 1], 3)
    adv = compute_advantages(t([1.0, 0.0]), [0, 1], "reinforce_plus_plus", mask=mask)
    s = math.sqrt(0.25 + 1e-8)
    torch.testing.assert_close(adv, t([[0.25 / s] * 3, [-0.75 / s, 0.0, 0.0]]))


def test_reinforce_plus_plus_discounts_by_the_trained_tokens_after_each():
    # gamma 1/2, reward 1 on a row of 3 trained tokens: returns 1/4, 1/2, 1; row 1 reward 0.
    # Values [1/4, 1/2, 1, 0]: mean 7/16; squares of the deviations 9/256, 1/256, 81/256,
    # 49/256, sum 140/256, unbiased var 140/768.
    mask = lengths_mask([3, 1], 3)
    adv = compute_advantages(t([1.0, 0.0]), [0, 0], "reinforce_plus_plus", mask=mask, gamma=0.5)
    std = math.sqrt(140 / 768 + 1e-8)
    want = [[(v - 7 / 16) / std for v in (0.25, 0.5, 1.0)], [(0 - 7 / 16) / std, 0.0, 0.0]]
    torch.testing.assert_close(adv, t(want))
    # an environment's tokens (mask 0 mid-trajectory) are not steps: the token before the
    # gap is one trained token from the end, so its return is 1/2 (not 1/4, not reset to 0)
    gap = torch.tensor([[1, 0, 1], [1, 0, 0]], dtype=torch.bool)
    adv = compute_advantages(t([1.0, 0.0]), [0, 0], "reinforce_plus_plus", mask=gap, gamma=0.5)
    # values [1/2, 1, 0]: mean 1/2 (the token before the gap sits at it), unbiased var 1/4
    s = math.sqrt(0.25 + 1e-8)
    torch.testing.assert_close(adv, t([[0.0, 0.0, 0.5 / s], [-0.5 / s, 0.0, 0.0]]))


def test_reinforce_plus_plus_baseline_centers_in_the_group_then_whitens_the_batch():
    # groups [1, 0] and [1, 1]; trained tokens 2, 1 | 1, 3. Centered in the group:
    # 1/2, -1/2 | 0, 0, on each token: [1/2, 1/2, -1/2, 0, 0, 0, 0]. Mean 1/14; deviations
    # 3/7 (x2), -4/7, -1/14 (x4); squares 18/49 + 16/49 + 4/196 = 5/7; unbiased var 5/42.
    mask = lengths_mask([2, 1, 1, 3], 3)
    adv = compute_advantages(
        t([1.0, 0.0, 1.0, 1.0]), [0, 0, 1, 1], "reinforce_plus_plus_baseline", mask=mask
    )
    std = math.sqrt(5 / 42 + 1e-8)
    a, b, c = (0.5 - 1 / 14) / std, (-0.5 - 1 / 14) / std, (0 - 1 / 14) / std
    torch.testing.assert_close(adv, t([[a, a, 0.0], [b, 0.0, 0.0], [c, 0.0, 0.0], [c, c, c]]))
    # unlike GRPO the all-equal group is not zero: the whitening is global
    assert adv[2, 0] < 0
    # a group of one keeps its reward as verl does: [3] alone, [0, 2] centered to -1, 1
    one = compute_advantages(
        t([3.0, 0.0, 2.0]), [5, 6, 6], "reinforce_plus_plus_baseline", mask=lengths_mask([1] * 3, 1)
    )
    values = [3.0, -1.0, 1.0]  # mean 1, unbiased var (4 + 4 + 0) / 2 = 4
    torch.testing.assert_close(one, t([[(v - 1) / math.sqrt(4 + 1e-8)] for v in values]))


def test_grpo_passk_gives_only_the_best_of_each_group_the_margin_over_the_second():
    # group 0 = [0.2, 0.9, 0.5]: the best (0.9) gets 0.9 - 0.5 = 0.4, divided by the unbiased
    # std: mean 8/15, squares (1/3)^2 + (11/30)^2 + (1/30)^2 = 0.24667, var 0.12333.
    # group 1 = [1, 1]: the first best gets 1 - 1 = 0.
    rewards, ids = t([0.2, 0.9, 0.5, 1.0, 1.0]), [0, 0, 0, 1, 1]
    adv = compute_advantages(rewards, ids, "grpo_passk", eps=0.0)
    std = math.sqrt(((0.2 - 8 / 15) ** 2 + (0.9 - 8 / 15) ** 2 + (0.5 - 8 / 15) ** 2) / 2)
    torch.testing.assert_close(adv, t([0.0, 0.4 / std, 0.0, 0.0, 0.0]))
    plain = compute_advantages(rewards, ids, "grpo_passk", norm_by_std=False)
    torch.testing.assert_close(plain, t([0.0, 0.4, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="at least 2 samples per group; group 1 has 1"):
        compute_advantages(t([0.0, 1.0, 1.0]), [0, 0, 1], "grpo_passk")


def test_per_token_estimators_need_the_mask_and_keep_its_shape():
    with pytest.raises(ValueError, match="'reinforce_plus_plus' works per token: pass mask="):
        compute_advantages(t([1.0, 0.0]), [0, 0], "reinforce_plus_plus")
    with pytest.raises(ValueError, match=r"mask must be \[B, T\] with B = 2"):
        compute_advantages(t([1.0, 0.0]), [0, 0], "rloo", mask=torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        compute_advantages(t([1.0]), [0], "reinforce_plus_plus", mask=torch.ones(1, 1), gamma=2)
    # equal returns everywhere: no signal, exactly 0 (not 0 / sqrt(1e-8) noise)
    flat = compute_advantages(
        t([0.1, 0.1]), [0, 1], "reinforce_plus_plus", mask=torch.ones(2, 3, dtype=torch.bool)
    )
    assert flat.tolist() == [[0.0] * 3, [0.0] * 3]
    empty = compute_advantages(t([]), [], "reinforce_plus_plus", mask=torch.ones(0, 4))
    assert empty.shape == (0, 4)


def test_every_estimator_is_a_documented_function_and_the_configs_allowed_values():
    for name in ADVANTAGE_ESTIMATORS.names:
        fn = ADVANTAGE_ESTIMATORS.get(name)
        assert inspect.isfunction(fn) and fn.__doc__ and "verl" in fn.__doc__, name
    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["advantage_estimator"]) == ADVANTAGE_ESTIMATORS.names
    with pytest.raises(ValueError, match="allowed: grpo, rloo, reinforce_plus_plus"):
        ADVANTAGE_ESTIMATORS.get("gae_typo")
    with pytest.raises(ConfigError, match=r"advantage_estimator='ppo' is not allowed: choose"):
        load_config(None, ["algorithm.advantage_estimator=ppo"])
    with pytest.raises(ConfigError, match="n_samples_per_prompt=1: set it to 2 or more"):
        load_config(
            None,
            ["algorithm.advantage_estimator=grpo_passk", "generator.n_samples_per_prompt=1"],
        )


def test_reading_the_registries_imports_no_torch(tmp_path):
    # the config checks its allowed values at load without torch (python -m trainer --help
    # and a bad key or value answer in about a second); only a valid config's run plan asks
    # torch what this machine has
    import subprocess

    code = (
        "import sys; from trainer.config import load_config\n"
        "try: load_config(None, ['algorithm.advantage_estimator=rloo', 'trainer.max_steps=0'])\n"
        "except Exception as exc: print(type(exc).__name__, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ConfigError False"
