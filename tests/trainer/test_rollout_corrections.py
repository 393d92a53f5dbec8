"""``algorithm.rollout_correction``: each importance weight and rejection mask against
hand-worked values, each composed with ppo, gspo and cispo, the plan's decisions and the
load-time refusals, and one real run with a mask."""

from __future__ import annotations

import json
import math

import pytest
import torch

import trainer.run
from trainer.algorithms import (
    ROLLOUT_IS,
    ROLLOUT_RS,
    RolloutCorrection,
    importance_weights_of,
    policy_loss,
    rejection_mask_of,
)
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.off_policy import correction_weights, rejection_mask

F64 = torch.float64
LN = math.log


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# Two sequences of old-over-rollout ratios rho: row 0 [0.5, 4, 1] (product 2, geometric mean
# 2^(1/3) = 1.26), row 1 [1.005, 0.999, pad] (product 1.003995, geometric mean 1.001996).
LOG_RATIO = t([[LN(0.5), LN(4.0), 0.0], [LN(1.005), LN(0.999), 0.0]])
VALID = torch.tensor([[True, True, True], [True, True, False]])


def test_token_is_truncates_each_ratio_at_the_threshold():
    w, m = importance_weights_of(RolloutCorrection("token", 2.0), LOG_RATIO, VALID)
    assert w is not None
    torch.testing.assert_close(w, t([[0.5, 2.0, 1.0], [1.005, 0.999, 0.0]]))
    assert m["is_truncated_frac"] == pytest.approx(1 / 5)  # the 4 of 5 tokens
    assert m["is_weight_max"] == pytest.approx(4.0)
    # p99 of [0.5, 4, 1, 1.005, 0.999] by linear interpolation: 1.005 + 0.96 * (4 - 1.005)
    assert m["is_weight_p99"] == pytest.approx(1.005 + 0.96 * 2.995)


def test_sequence_is_puts_the_truncated_product_on_every_token():
    w, m = importance_weights_of(RolloutCorrection("sequence", 1.5), LOG_RATIO, VALID)
    assert w is not None
    # row 0: product 2 -> 1.5; row 1: 1.005 * 0.999 = 1.003995 (under the cap), pad 0
    p1 = 1.005 * 0.999
    torch.testing.assert_close(w, t([[1.5, 1.5, 1.5], [p1, p1, 0.0]]))
    assert m["is_truncated_frac"] == 0.5  # one sequence of two
    assert m["is_weight_max"] == pytest.approx(2.0)
    # uncapped it is the product itself
    w, _ = importance_weights_of(RolloutCorrection("sequence", None), LOG_RATIO, VALID)
    assert w is not None and w[0, 0].item() == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("rs", "lower", "upper", "keep", "token_frac", "seq_frac"),
    [
        # token: 0.5 and 4 fall outside [0.6, 2]
        ("token", 0.6, 2.0, [[0, 0, 1], [1, 1, 0]], 2 / 5, 0.0),
        # sequence: row 0's product 2 is outside [0.5, 1.9]; row 1's 1.004 inside
        ("sequence", 0.5, 1.9, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
        # geometric with SkyRL's [0.99, 1.01]: row 0's 1.26 is out, row 1's 1.002 in
        ("geometric", 0.99, 1.01, [[0, 0, 0], [1, 1, 0]], 3 / 5, 1 / 2),
        # icepop b = 3: tokens outside [1/3, 3]: the 4 alone (lower is not read)
        ("icepop", 123.0, 3.0, [[1, 0, 1], [1, 1, 0]], 1 / 5, 0.0),
    ],
)
def test_each_rejection_mask_on_hand_worked_ratios(rs, lower, upper, keep, token_frac, seq_frac):
    spec = RolloutCorrection(rollout_rs=rs, rs_lower=lower, rs_upper=upper)
    kept, m = rejection_mask_of(spec, LOG_RATIO, VALID)
    assert kept.tolist() == [[bool(v) for v in row] for row in keep]
    assert m == pytest.approx({"rs_rejected_frac": token_frac, "rs_rejected_seq_frac": seq_frac})
    assert all(type(v) is float for v in m.values())


def test_every_registered_correction_is_tested_here():
    assert ROLLOUT_IS.names == ("token", "sequence")
    assert ROLLOUT_RS.names == ("token", "sequence", "geometric", "icepop")


def test_the_mask_leaves_the_loss_mask_in_its_dtype_and_ignores_garbage_at_padding():
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    rollout = old - t([[LN(4.0), 0.0], [0.0, math.nan]])  # nan at a masked position
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    spec = RolloutCorrection(rollout_rs="token", rs_lower=0.5, rs_upper=2.0)
    kept, m = rejection_mask(old, rollout, mask, spec)
    assert kept.dtype == mask.dtype and kept.tolist() == [[0.0, 1.0], [1.0, 0.0]]
    assert m["rs_rejected_frac"] == pytest.approx(1 / 3)
    # no mask: the loss mask itself, no metrics
    same, none = rejection_mask(old, rollout, mask, RolloutCorrection())
    assert torch.equal(same, mask) and none == {}


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo"])
@pytest.mark.parametrize(
    "spec",
    [RolloutCorrection(rollout_is=name) for name in ROLLOUT_IS.names]
    + [RolloutCorrection(rollout_rs=name, rs_lower=0.6, rs_upper=3.0) for name in ROLLOUT_RS.names],
    ids=lambda s: f"is={s.rollout_is}-rs={s.rollout_rs}",
)
def test_each_correction_composes_with_each_loss_and_rejected_tokens_contribute_nothing(loss, spec):
    g = torch.Generator().manual_seed(0)
    old = -1.0 - torch.rand(2, 3, generator=g, dtype=F64)
    rollout = old - LOG_RATIO
    logp = (old + 0.05 * torch.randn(2, 3, generator=g, dtype=F64)).requires_grad_()
    mask = VALID.double()
    agg = "seq-mean-token-mean" if loss == "gspo" else "token-mean"
    kept, _ = rejection_mask(old, rollout, mask, spec)
    weights, _ = correction_weights(old, rollout, kept, spec)
    value, _ = policy_loss(
        logp, old, t([1.0, -1.0]), kept, loss=loss, loss_agg_mode=agg, token_weights=weights
    )
    value.backward()
    assert logp.grad is not None
    assert math.isfinite(value.item()) and bool(torch.isfinite(logp.grad).all())
    rejected = (mask != 0) & (kept == 0)
    assert bool((logp.grad[rejected] == 0).all())
    # a rejected token's log-prob can be anything: the loss does not move
    if bool(rejected.any()):
        moved = logp.detach().clone()
        moved[rejected] += 3.0
        again, _ = policy_loss(
            moved, old, t([1.0, -1.0]), kept, loss=loss, loss_agg_mode=agg, token_weights=weights
        )
        assert again.item() == pytest.approx(value.item())


# --------------------------------------------------------------------------- config and plan


def _plan(*overrides: str) -> RolloutCorrection:
    return load_config(None, list(overrides)).plan.correction


def test_the_plan_makes_one_correction_of_the_keys():
    key = "algorithm.rollout_correction"
    assert _plan(f"{key}.rollout_is=sequence", f"{key}.rollout_is_threshold=5") == (
        RolloutCorrection(rollout_is="sequence", rollout_is_threshold=5.0)
    )
    # each mask's default bounds, and one threshold alone gives [1 / t, t]
    assert (
        _plan(f"{key}.rollout_rs=geometric").rs_lower,
        _plan(f"{key}.rollout_rs=geometric").rs_upper,
    ) == (0.99, 1.01)
    tok = _plan(f"{key}.rollout_rs=token", f"{key}.rollout_rs_threshold=4")
    assert (tok.rs_lower, tok.rs_upper) == (0.25, 4.0)
    ice = _plan(f"{key}.rollout_rs=icepop", f"{key}.rollout_rs_threshold=5")
    assert (ice.rs_lower, ice.rs_upper) == (0.2, 5.0)
    # the older keys map onto token TIS; a mask composes with them
    legacy = _plan(
        "algorithm.off_policy_correction=tis", "algorithm.tis_cap=3", f"{key}.rollout_rs=token"
    )
    assert (legacy.rollout_is, legacy.rollout_is_threshold, legacy.rollout_rs) == (
        "token",
        3.0,
        "token",
    )


def test_the_plan_decides_whether_the_old_logprobs_are_recomputed():
    key = "algorithm.rollout_correction"
    # one update per batch (the default): the update's forward has them, unless a mask must
    # read them first; bypass never recomputes
    assert not load_config(None, []).plan.recomputes_old_logprobs
    assert load_config(None, [f"{key}.rollout_rs=token"]).plan.recomputes_old_logprobs
    assert load_config(None, ["trainer.update_epochs=2"]).plan.recomputes_old_logprobs
    bypass = load_config(None, ["trainer.update_epochs=2", f"{key}.bypass_mode=true"]).plan
    assert bypass.correction.bypass_mode and not bypass.recomputes_old_logprobs
    # fully-async's automatic TIS gives way to bypass (its ratio would be 1)
    fa = load_config(None, ["trainer.strategy=fully_async", f"{key}.bypass_mode=true"]).plan
    assert fa.correction.rollout_is is None


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["rollout_is=token", "@off_policy_correction=tis"], r"both choose importance weights"),
        (["bypass_mode=true", "rollout_rs=token"], r"bypass_mode=true .* ratio of exactly 1"),
        (["bypass_mode=true", "@off_policy_correction=tis"], r"ratio of exactly 1: set it to none"),
        (
            ["rollout_rs=icepop", "rollout_rs_threshold_lower=0.3"],
            r"unset rollout_rs_threshold_lower",
        ),
        (["rollout_rs=icepop", "rollout_rs_threshold=0.9"], r"must be > 1 for icepop"),
        (
            ["rollout_rs=token", "rollout_rs_threshold=2", "rollout_rs_threshold_lower=3"],
            r"must be below",
        ),
        (["rollout_rs=tokens"], r"rollout_rs"),
        (["rollout_is=geometric"], r"rollout_is"),
        (["rollout_is_threshold=0"], r"rollout_is_threshold=0.0 is out of range: must be > 0"),
    ],
)
def test_contradictions_and_bad_values_are_refused_at_load_with_one_line(overrides, match):
    keys = [
        f"algorithm.{o[1:]}" if o.startswith("@") else f"algorithm.rollout_correction.{o}"
        for o in overrides
    ]
    with pytest.raises(ConfigError, match=match) as caught:
        load_config(None, keys)
    assert "\n" not in str(caught.value)


async def test_a_run_with_a_token_mask_recomputes_old_logprobs_and_reports_its_rejections(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=inprocess",
            "algorithm.rollout_correction.rollout_rs=token",
            "algorithm.rollout_correction.rollout_is=sequence",
            "trainer.max_steps=2",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=4",
            "data.reward_fn=tests.trainer.helpers:varied_reward",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
        ],
    )
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # a sync run samples with the weights it trains: ratios ~1, nothing rejected or capped
        assert r["policy/rs_rejected_frac"] == 0.0 and r["policy/rs_rejected_seq_frac"] == 0.0
        assert r["policy/is_truncated_frac"] == 0.0
        assert 0.5 <= r["policy/is_weight_max"] <= 2.0
        assert "timing/fwd_logprobs_values_reward" in r


async def test_a_bypass_run_takes_the_rollouts_logprobs_as_the_old_ones(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=inprocess",
            "algorithm.rollout_correction.bypass_mode=true",
            "trainer.update_epochs=2",  # a forward would otherwise recompute the old logprobs
            "trainer.max_steps=2",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=4",
            "data.reward_fn=tests.trainer.helpers:varied_reward",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
        ],
    )
    assert not cfg.plan.recomputes_old_logprobs
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        # old is the rollout's, bit for bit: the ratio is exactly 1 (a recompute gives 1 +- 1e-6)
        assert r["policy/is_ratio_min"] == r["policy/is_ratio_max"] == 1.0
        assert r["policy/num_tokens"] > 0
