"""Off-policy correction: truncated importance weights against hand-computed values, in the loss,
in the policy worker, and in a real run."""

from __future__ import annotations

import json
import math
import typing

import pytest
import torch

import trainer.run
from engines.models import build_tiny_model
from trainer.algorithms import RolloutCorrection, policy_loss
from trainer.config import load_config
from trainer.config._schema import AlgorithmConfig
from trainer.errors import ConfigError
from trainer.off_policy import (
    IS_RATIO_METRICS,
    OFF_POLICY_CORRECTIONS,
    importance_weights,
)
from trainer.workers.batch import TrainBatch
from trainer.workers.policy import PolicyWorker

F64 = torch.float64
TOKEN_TIS = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _behaviour(ratios: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``old`` and ``rollout`` logprobs whose ``exp(old - rollout)`` is ``ratios``."""
    old = t([[-1.0] * len(row) for row in ratios])
    rollout = old - t([[math.log(r) for r in row] for row in ratios])
    return old, rollout


# --------------------------------------------------------------------------- the weights


def test_tis_weight_is_old_over_rollout_truncated_at_the_cap_and_zero_where_masked():
    # behaviour ratios 0.5 (below 1), 1.5 (below the cap), 3.0 (above it); the 4th is masked
    old, rollout = _behaviour([[0.5, 1.5, 3.0, 1.0]])
    rollout[0, 3] = math.nan  # garbage at a masked position
    mask = torch.tensor([[1, 1, 1, 0]])
    w, m = importance_weights(old, rollout, mask, "tis", cap=2.0)
    assert w is not None
    torch.testing.assert_close(w, t([[0.5, 1.5, 2.0, 0.0]]))
    # metrics are of the ratio before truncation: mean (0.5 + 1.5 + 3) / 3
    assert m["is_ratio_mean"] == pytest.approx(5 / 3)
    assert m["is_ratio_max"] == pytest.approx(3.0)
    assert m["is_ratio_min"] == pytest.approx(0.5)
    assert m["is_truncated_frac"] == pytest.approx(1 / 3)
    assert all(type(v) is float for v in m.values())


def test_without_a_cap_the_weight_is_the_whole_ratio():
    old, rollout = _behaviour([[0.5, 1.5, 3.0]])
    w, m = importance_weights(old, rollout, torch.ones(1, 3), "tis", cap=None)
    assert w is not None
    torch.testing.assert_close(w, t([[0.5, 1.5, 3.0]]))
    assert m["is_truncated_frac"] == 0.0


def test_none_gives_no_weights_but_still_reports_how_off_policy_the_batch_is():
    old, rollout = _behaviour([[0.5, 4.0]])
    w, m = importance_weights(old, rollout, torch.ones(1, 2), "none")
    assert w is None
    assert m == pytest.approx({"is_ratio_mean": 2.25, "is_ratio_max": 4.0, "is_ratio_min": 0.5})
    assert set(m) == set(IS_RATIO_METRICS)


def test_weights_with_no_valid_token_are_zero_not_nan():
    old, rollout = _behaviour([[2.0, 3.0]])
    w, m = importance_weights(old, rollout, torch.zeros(1, 2), "tis")
    assert w is not None and w.tolist() == [[0.0, 0.0]]
    assert m == dict.fromkeys(
        (*IS_RATIO_METRICS, "is_truncated_frac", "is_weight_p99", "is_weight_max"), 0.0
    )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(correction="is"), r"unknown off-policy correction 'is'; allowed: none, tis"),
        (dict(mask=torch.ones(1, 3)), "one shape"),
        (dict(cap=0.0), r"cap must be > 0"),
    ],
)
def test_importance_weights_reject_bad_input(kwargs, match):
    args = dict(
        old_logprobs=torch.zeros(1, 2),
        rollout_logprobs=torch.zeros(1, 2),
        mask=torch.ones(1, 2),
        correction="tis",
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        importance_weights(**args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the loss


def _mixed_batch():
    # PPO ratios as in test_algorithms' mixed batch:
    # row 0 (A = +1): 1.1 (unclipped), 1.5 (clipped high), 0.5 (pessimistic, unclipped)
    # row 1 (A = -1): 0.5 (clipped low), 1.1 (unclipped), then one padding token
    ratios = [[1.1, 1.5, 0.5], [0.5, 1.1, 3.0]]
    logp = t([[math.log(r) for r in row] for row in ratios]).requires_grad_()
    old = torch.zeros(2, 3, dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # behaviour ratios exp(old - rollout): 0.5, 3.0 (capped to 2), 1.0 | 1.5, 2.5 (capped), pad
    rollout = -t([[math.log(0.5), math.log(3.0), 0.0], [math.log(1.5), math.log(2.5), 0.0]])
    rollout[1, 2] = math.inf  # garbage at the padding
    return logp, old, rollout, t([1.0, -1.0]), mask


def test_tis_loss_on_hand_computed_values():
    logp, old, rollout, adv, mask = _mixed_batch()
    w, is_m = importance_weights(old, rollout, mask, "tis", cap=2.0)
    loss, m = policy_loss(logp, old, adv, mask, token_weights=w)
    # plain per-token terms -1.1, -1.2, -0.5 | 0.8, 1.1 times weights 0.5, 2, 1 | 1.5, 2:
    # -0.55 - 2.4 - 0.5 + 1.2 + 2.2 = -0.05, over 5 tokens = -0.01
    assert loss.item() == pytest.approx(-0.01)
    assert m["pg_loss"] == pytest.approx(-0.01)
    # the PPO metrics are the ratio's, untouched by the weights
    assert m["clip_frac"] == pytest.approx(0.4) and m["ratio_mean"] == pytest.approx(0.94)
    # behaviour ratios 0.5, 3, 1, 1.5, 2.5: mean 1.7; 3 and 2.5 are capped -> 2 / 5
    assert is_m["is_ratio_mean"] == pytest.approx(1.7)
    assert (is_m["is_ratio_max"], is_m["is_ratio_min"]) == pytest.approx((3.0, 0.5))
    assert is_m["is_truncated_frac"] == pytest.approx(0.4)
    loss.backward()
    # grad = -A * ratio * w / 5 where unclipped; 0 where clipped or padded
    expected = t([[-1.1 * 0.5 / 5, 0.0, -0.5 * 1.0 / 5], [0.0, 1.1 * 2.0 / 5, 0.0]])
    torch.testing.assert_close(logp.grad, expected)


def test_uncapped_tis_loss_is_the_decoupled_ppo_objective():
    logp, old, rollout, adv, mask = _mixed_batch()
    w, _ = importance_weights(old, rollout, mask, "tis", cap=None)
    loss, _ = policy_loss(logp, old, adv, mask, token_weights=w)
    # weights 0.5, 3, 1 | 1.5, 2.5: -0.55 - 3.6 - 0.5 + 1.2 + 2.75 = -0.7, over 5 = -0.14
    assert loss.item() == pytest.approx(-0.14)


def test_on_policy_samples_leave_the_tis_loss_exactly_the_plain_loss():
    logp, old, _, adv, mask = _mixed_batch()
    plain, _ = policy_loss(logp, old, adv, mask)
    w, m = importance_weights(old, old.clone(), mask, "tis")
    weighted, _ = policy_loss(logp, old, adv, mask, token_weights=w)
    assert weighted.item() == plain.item()  # x * 1.0 is x, bit for bit
    assert m["is_truncated_frac"] == 0.0


def test_token_weights_must_match_the_logprobs():
    logp, old, _, adv, mask = _mixed_batch()
    with pytest.raises(ValueError, match=r"token_weights must have logprobs' shape \(2, 3\)"):
        policy_loss(logp, old, adv, mask, token_weights=torch.ones(2, 2))


# --------------------------------------------------------------------------- the worker


@pytest.fixture(scope="module")
def model_dir():
    return build_tiny_model()


def _batch(rows: int = 4, width: int = 10) -> TrainBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.zeros(rows, width - 1)
    mask[:, 3:] = 1.0
    mask[0, -2:] = 0.0  # a shorter response
    return TrainBatch(
        input_ids=torch.randint(0, 50, (rows, width), generator=g),
        attention_mask=torch.ones(rows, width, dtype=torch.long),
        loss_mask=mask,
        advantages=torch.randn(rows, generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(rows, width - 1, generator=g),
    )


def _step(worker: PolicyWorker, batch: TrainBatch) -> tuple[dict[str, float], torch.Tensor]:
    metrics = worker.forward_backward(batch)
    grad = torch.cat([p.grad.reshape(-1) for p in worker.model.parameters()])  # type: ignore[union-attr]
    worker.optimizer.zero_grad(set_to_none=True)
    return metrics, grad


def test_worker_with_none_trains_exactly_as_without_rollout_logprobs(model_dir):
    worker = PolicyWorker(model_dir, lr=1e-3, micro_batch_size=3)
    plain = _batch()
    lagging = _batch()
    assert plain.old_logprobs is not None
    lagging.rollout_logprobs = (plain.old_logprobs - 0.7) * plain.loss_mask  # ratio e^0.7
    m_plain, g_plain = _step(worker, plain)
    m_lag, g_lag = _step(worker, lagging)
    assert m_lag["policy/loss"] == m_plain["policy/loss"]
    assert torch.equal(g_lag, g_plain)
    assert not any(k.startswith("policy/is_") for k in m_plain)
    # the diagnostic is there all the same, and no truncation is reported: nothing is capped
    assert m_lag["policy/is_ratio_mean"] == pytest.approx(math.exp(0.7), rel=1e-5)
    assert "policy/is_truncated_frac" not in m_lag


def test_worker_with_tis_weighs_each_token_by_its_capped_weight_across_micro_batches(model_dir):
    plain = PolicyWorker(model_dir, lr=1e-3, micro_batch_size=3)
    tis = PolicyWorker(model_dir, lr=1e-3, micro_batch_size=3, rollout_correction=TOKEN_TIS)
    batch = _batch()
    assert batch.old_logprobs is not None and batch.advantages is not None
    # rows 0-1 were sampled by a policy 4x less likely (ratio 4, weight capped to 2), rows
    # 2-3 on-policy (weight 1); micro-batches are rows 0-2 and row 3
    weight = torch.tensor([2.0, 2.0, 1.0, 1.0])
    lag = torch.tensor([math.log(4.0)] * 2 + [0.0] * 2)[:, None]
    batch.rollout_logprobs = (batch.old_logprobs - lag) * batch.loss_mask
    m_tis, g_tis = _step(tis, batch)
    # a positive weight constant over a row is the same as scaling the row's advantage:
    # w * max(-A r, -A clip(r)) = max(-(wA) r, -(wA) clip(r))
    scaled = _batch()
    assert scaled.advantages is not None
    scaled.advantages = scaled.advantages * weight
    m_plain, g_plain = _step(plain, scaled)
    torch.testing.assert_close(g_tis, g_plain, rtol=1e-5, atol=1e-7)
    assert m_tis["policy/loss"] == pytest.approx(m_plain["policy/loss"], rel=1e-5)
    n0, n_all = batch.select(slice(0, 2)).num_tokens, batch.num_tokens
    # token-weighted over the micro-batches: ratio 4 on rows 0-1's tokens, 1 elsewhere
    assert m_tis["policy/is_ratio_mean"] == pytest.approx((4 * n0 + (n_all - n0)) / n_all)
    assert m_tis["policy/is_ratio_max"] == pytest.approx(4.0)
    assert m_tis["policy/is_ratio_min"] == pytest.approx(1.0)
    assert m_tis["policy/is_truncated_frac"] == pytest.approx(n0 / n_all)


def test_worker_with_tis_needs_rollout_logprobs(model_dir):
    worker = PolicyWorker(model_dir, lr=1e-3, rollout_correction=TOKEN_TIS)
    with pytest.raises(ValueError, match=r"rollout_is='token' needs the batch's rollout"):
        worker.forward_backward(_batch())


# --------------------------------------------------------------------------- config and a run


def test_config_keys_default_to_auto_and_check_their_values():
    cfg = load_config(None, [])
    assert (cfg.algorithm.off_policy_correction, cfg.algorithm.tis_cap) == ("auto", 2.0)
    # the config's choices are the loss's plus auto (the schema does not import torch)
    hints = typing.get_type_hints(AlgorithmConfig)
    assert typing.get_args(hints["off_policy_correction"]) == ("auto", *OFF_POLICY_CORRECTIONS)
    # auto: corrected where the sampler lags (fully-async), plain where it does not; the run
    # plan decides it once
    for overrides, correction in [
        ([], None),
        (["trainer.strategy=fully_async"], "token"),
        (
            [
                "trainer.strategy=fully_async",
                "trainer.fully_async.max_staleness_steps=0",
                "algorithm.off_policy_correction=none",
            ],
            None,
        ),
        (["algorithm.off_policy_correction=tis"], "token"),
    ]:
        assert load_config(None, overrides).plan.correction.rollout_is == correction
    cfg = load_config(None, ["algorithm.off_policy_correction=tis", "algorithm.tis_cap=null"])
    assert (cfg.algorithm.off_policy_correction, cfg.algorithm.tis_cap) == ("tis", None)
    with pytest.raises(ConfigError, match=r"choose one of 'auto', 'none', 'tis'"):
        load_config(None, ["algorithm.off_policy_correction=is"])
    with pytest.raises(ConfigError, match=r"algorithm.tis_cap=0.5 .*must be >= 1"):
        load_config(None, ["algorithm.tis_cap=0.5"])


async def test_a_sync_run_with_tis_reports_weights_near_one(tmp_path):
    cfg = load_config(
        None,
        [
            "engine.backend=inprocess",
            "algorithm.off_policy_correction=tis",
            "trainer.max_steps=3",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=4",
            # rewards that differ between samples, so the policy really moves between steps
            "data.reward_fn=tests.trainer.helpers:varied_reward",
            f"trainer.run_dir={tmp_path}",
            "trainer.progress=false",
        ],
    )
    await trainer.run.train(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    for r in steps:
        # A sync run samples each step with the weights just trained and synced, so the
        # engine's logprobs equal the recomputed old ones up to numerics: the ratio is ~1
        # (it is 1 +- 1e-6 here). The bound is generous on purpose; what it catches is a
        # misaligned or missing rollout logprob (shifted by a token, or 0.0 for a sampled
        # token), which puts ratios orders of magnitude away from 1.
        assert 0.5 <= r["policy/is_ratio_min"] <= r["policy/is_ratio_mean"]
        assert r["policy/is_ratio_mean"] <= r["policy/is_ratio_max"] <= 2.0
        assert r["policy/is_truncated_frac"] == 0.0
        assert r["policy/num_tokens"] > 0
