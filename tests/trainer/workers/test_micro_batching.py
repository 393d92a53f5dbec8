"""Micro-batches packed by a token budget (``trainer.micro_batch_max_tokens``), each padded only
to its own longest row: the gradient, the metrics and the logprobs of one full-batch call."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.trainer.workers.test_logprobs import model_dir as model_dir  # the fixture
from tests.trainer.workers.test_logprobs import padded_multi_turn_batch
from trainer.algorithms import LOSS_AGG_MODES
from trainer.config import load_config
from trainer.errors import ConfigError
from trainer.run._parts import policy_kwargs
from trainer.workers.policy import PolicyWorker, RefWorker
from trainer.workers.training import MicroBatching, token_budget_micro_batches


def test_packing_respects_the_budget_and_the_row_limit_longest_first():
    lengths = [12, 3, 7, 9, 5, 12, 30]
    packed = token_budget_micro_batches(lengths, 24)
    assert packed == [[6], [0, 5], [2, 3], [1, 4]]  # 30 > 24 goes alone
    assert sorted(i for rows in packed for i in rows) == list(range(len(lengths)))
    for rows in packed[1:]:
        assert len(rows) * max(lengths[i] for i in rows) <= 24
    assert token_budget_micro_batches(lengths, 1000, max_rows=3) == [[0, 5, 6], [2, 3, 4], [1]]
    assert token_budget_micro_batches([], 10) == []


def test_a_micro_batch_is_padded_only_to_its_longest_row(model_dir):
    batch = padded_multi_turn_batch(model_dir)
    assert batch.lengths == [12, 10, 7, 9, 5, 12]
    short = batch.select([2, 4]).trimmed()
    assert short.input_ids.shape == (2, 7) and short.loss_mask.shape == (2, 6)
    assert short.advantages is not None and short.advantages.shape == (2,)
    assert short.old_logprobs is not None and short.old_logprobs.shape == (2, 6)
    torch.testing.assert_close(short.loss_mask, batch.loss_mask[[2, 4], :6])
    whole = batch.select([0, 1])
    assert whole.trimmed() is whole  # already padded to its longest
    plan = MicroBatching(max_tokens=20).plan(batch)
    assert plan == [[0], [5], [1, 3], [2, 4]]


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names)
def test_token_budget_micro_batches_give_the_gradient_of_one_full_batch_call(model_dir, mode):
    """The real worker (tiny model, KL term on): passes of at most 20 padded tokens (four
    of them, one with a row that has no trained token) or 30 against one pass over the whole batch."""
    kwargs: dict[str, Any] = dict(
        lr=1e-3,
        seed=0,
        loss_agg_mode=mode,
        loss_scale_factor=4.0,
        kl_loss_coef=0.1,
        policy_loss="cispo",
    )
    batch = padded_multi_turn_batch(model_dir, seed=2)
    grads, metrics = [], []
    for budget in (None, 20, 30):
        worker = PolicyWorker(model_dir, micro_batch_max_tokens=budget, **kwargs)
        metrics.append(worker.forward_backward(batch, batch.counts))
        grads.append(torch.cat([p.grad.reshape(-1) for p in worker.model.parameters()]))  # type: ignore[union-attr]
    for got, got_metrics in zip(grads[1:], metrics[1:]):
        torch.testing.assert_close(got, grads[0], rtol=1e-5, atol=1e-7)
        assert got_metrics.keys() == metrics[0].keys()
        for key, value in metrics[0].items():
            assert got_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert metrics[0]["policy/num_tokens"] == 8 + 5 + 2 + 0 + 3 + 6


def test_token_budget_logprobs_equal_one_pass_in_the_batchs_row_order(model_dir):
    batch = padded_multi_turn_batch(model_dir)
    one = RefWorker(model_dir).compute_logprobs(batch)
    for budget, size in ((20, None), (24, 1), (1, None)):
        ref = RefWorker(model_dir, micro_batch_max_tokens=budget, micro_batch_size=size)
        torch.testing.assert_close(ref.compute_logprobs(batch), one, rtol=0, atol=1e-6)
    policy = PolicyWorker(model_dir, lr=1e-3, micro_batch_max_tokens=20)
    torch.testing.assert_close(policy.compute_logprobs(batch), one, rtol=0, atol=1e-6)


def test_the_budget_is_a_config_key_the_workers_get():
    cfg = load_config(None, ["trainer.micro_batch_max_tokens=512"])
    assert policy_kwargs(cfg)["micro_batch_max_tokens"] == 512
    assert policy_kwargs(load_config(None, []))["micro_batch_max_tokens"] is None
    with pytest.raises(ConfigError, match="micro_batch_max_tokens"):
        load_config(None, ["trainer.micro_batch_max_tokens=0"])
