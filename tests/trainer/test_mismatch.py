"""The mismatch diagnostics (``mismatch/*``) against hand-worked values, and exact when a step's
tokens are scored in parts."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.algorithms import MISMATCH_SUMS, fold_mismatch_sums, mismatch_metrics, mismatch_sums

# Three trained tokens (and one masked one, whose garbage must not count): the trainer's
# probabilities p = [1/2, 1/4, 1], the engine's q = [1/4, 1/4, 1/2].
P = torch.log(torch.tensor([[0.5, 0.25], [1.0, 1e-9]]))
Q = torch.log(torch.tensor([[0.25, 0.25], [0.5, 0.9]]))
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])


def test_each_diagnostic_has_its_hand_worked_value():
    m = mismatch_metrics(mismatch_sums(P, Q, MASK))
    # |log p - log q| = [ln 2, 0, ln 2]
    assert m["mismatch/logprob_abs_diff_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert m["mismatch/logprob_abs_diff_max"] == pytest.approx(math.log(2))
    # w = p / q = [2, 1, 2]: (sum w)^2 / (n sum w^2) = 25 / (3 * 9)
    assert m["mismatch/is_ess"] == pytest.approx(25 / 27)
    # cov(p, q) = 5/48, var p = 7/24, var q = 1/24 (sums of squared deviations): 5 / (2 sqrt 7)
    assert m["mismatch/prob_pearson"] == pytest.approx(5 / (2 * math.sqrt(7)))
    assert set(m) == {
        "mismatch/logprob_abs_diff_mean",
        "mismatch/logprob_abs_diff_max",
        "mismatch/is_ess",
        "mismatch/prob_pearson",
    }


def test_identical_logprobs_are_no_mismatch():
    m = mismatch_metrics(mismatch_sums(P, P, MASK))
    assert m["mismatch/logprob_abs_diff_mean"] == 0.0
    assert m["mismatch/logprob_abs_diff_max"] == 0.0
    assert m["mismatch/is_ess"] == pytest.approx(1.0)
    assert m["mismatch/prob_pearson"] == pytest.approx(1.0)


def test_one_token_carrying_every_weight_has_an_ess_of_one_over_n():
    p = torch.tensor([[0.0, -30.0, -30.0, -30.0]])  # w = [1, e^-30, ...]: ESS -> 1/4
    m = mismatch_metrics(mismatch_sums(p, torch.zeros(1, 4), torch.ones(1, 4)))
    assert m["mismatch/is_ess"] == pytest.approx(0.25, rel=1e-6)


def test_sums_of_parts_give_the_whole_batchs_numbers_exactly():
    gen = torch.Generator().manual_seed(0)
    p = -torch.rand(6, 7, generator=gen) * 3
    q = p + torch.randn(6, 7, generator=gen) * 0.2
    mask = (torch.rand(6, 7, generator=gen) > 0.3).float()
    whole = mismatch_metrics(mismatch_sums(p, q, mask))
    totals: dict[str, float] = {}
    for rows in ([0], [1, 2, 3], [4, 5]):  # micro-batches of uneven sizes
        fold_mismatch_sums(totals, mismatch_sums(p[rows], q[rows], mask[rows]))
    assert set(totals) == set(MISMATCH_SUMS)
    parts = mismatch_metrics(totals)
    assert parts.keys() == whole.keys()
    for key in whole:
        assert parts[key] == pytest.approx(whole[key], rel=1e-12), key
    # a mean of the parts' own means would not be exact: the check above can fail
    valid = mask != 0
    expected_max = float((p - q).abs()[valid].max())
    assert parts["mismatch/logprob_abs_diff_max"] == pytest.approx(expected_max)


def test_no_trained_token_gives_no_diagnostic_and_pearson_needs_spread():
    assert mismatch_metrics(mismatch_sums(P, Q, torch.zeros(2, 2))) == {}
    one = mismatch_metrics(mismatch_sums(P, Q, torch.tensor([[1.0, 0.0], [0.0, 0.0]])))
    assert "mismatch/prob_pearson" not in one  # one token: no correlation
    assert one["mismatch/logprob_abs_diff_mean"] == pytest.approx(math.log(2))
