"""``algorithm.loss_agg_mode``: each mode against hand-worked values, and exact under
micro-batches, mini-batches and data parallel (the parts' gradients add up to one call's over
the whole mini-batch)."""

from __future__ import annotations

import inspect
import itertools
import typing
from pathlib import Path

import pytest
import torch

from engines.models import resolve_model_path
from trainer.algorithms import LOSS_AGG_MODES, BatchCounts, aggregate, policy_loss
from trainer.config import load_config
from trainer.config._schema import AlgorithmConfig
from trainer.errors import ConfigError
from trainer.run._parts import policy_kwargs
from trainer.workers.batch import TrainBatch
from trainer.workers.policy import PolicyWorker

F64 = torch.float64
#: A mode's scale factor where it takes one (seq-mean-token-sum-norm's constant length).
L = 4.0


def test_each_mode_on_a_hand_worked_batch():
    # losses [1, 2, 3] and [4, -, -]: N = 4 tokens, S = 2 sequences
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    want = {
        "token-mean": 10 / 4,
        "seq-mean-token-sum": (6 + 4) / 2,
        "seq-mean-token-mean": (6 / 3 + 4 / 1) / 2,
        "seq-mean-token-sum-norm": 10 / (2 * L),
        "token-sum": 10,
    }
    assert set(want) == set(LOSS_AGG_MODES.names)
    for mode, value in want.items():
        assert aggregate(per_token, mask, mode, scale_factor=L).item() == value, mode
    # a row with no trained token is not a sequence of the batch
    padded = torch.cat([per_token, torch.full((1, 3), 7.0, dtype=F64)])
    padded_mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    assert BatchCounts.of(padded_mask) == BatchCounts(tokens=4, sequences=2)
    for mode, value in want.items():
        assert aggregate(padded, padded_mask, mode, scale_factor=L).item() == value, mode
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm' divides by a constant"):
        aggregate(per_token, mask, "seq-mean-token-sum-norm")


def _random_batch(seed: int, rows: int = 6, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = torch.randn(rows, width, generator=g, dtype=F64) * 0.3 - 1
    old = logp + torch.randn(rows, width, generator=g, dtype=F64) * 0.3
    adv = torch.randn(rows, generator=g, dtype=F64)
    lengths = torch.tensor([7, 1, 4, 0, 2, 5][:rows])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return logp, old, adv, mask


@pytest.mark.parametrize(
    ("mode", "loss"),
    [
        (mode, loss)
        for mode, loss in itertools.product(LOSS_AGG_MODES.names, ("ppo", "gspo", "cispo"))
        if loss != "gspo" or mode == "seq-mean-token-mean"
    ],
)
def test_micro_batches_and_ranks_with_the_mini_batchs_counts_reproduce_one_call(mode, loss):
    logp, old, adv, mask = _random_batch(seed=len(mode) + len(loss))
    kwargs = dict(loss=loss, loss_agg_mode=mode, scale_factor=L, clip_ratio_c=3.0)
    full_logp = logp.clone().requires_grad_()
    full, _ = policy_loss(full_logp, old, adv, mask, **kwargs)
    full.backward()
    # two "ranks" of three and three rows, each in micro-batches of uneven sizes (one row
    # has no trained token), all normalized by the whole mini-batch's counts
    counts = BatchCounts.of(mask)
    part_logp = logp.clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4), slice(4, 6)):
        part, _ = policy_loss(
            part_logp[rows], old[rows], adv[rows], mask[rows], counts=counts, **kwargs
        )
        part.backward()
        total = total + part.detach()
    torch.testing.assert_close(total, full.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(part_logp.grad, full_logp.grad, rtol=1e-12, atol=1e-12)
    if mode == "token-sum":  # divides by no count: any split adds up to the whole
        return
    # each part normalized by its own counts instead is not the same loss
    own = sum(
        policy_loss(logp[r], old[r], adv[r], mask[r], **kwargs)[0].item()
        for r in (slice(0, 1), slice(1, 3), slice(4, 6))
    )
    assert own != pytest.approx(full.item(), rel=1e-6)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model_path(None)


def _batch(model_dir: Path) -> TrainBatch:
    import json

    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (5, 10), generator=g)
    mask = torch.zeros(5, 9)
    for row, (start, end) in enumerate([(3, 9), (3, 4), (3, 7), (3, 3), (3, 8)]):
        mask[row, start:end] = 1.0  # row 3 has no trained token
    return TrainBatch(
        input_ids=ids,
        attention_mask=torch.ones(5, 10, dtype=torch.long),
        loss_mask=mask,
        advantages=torch.randn(5, generator=g),
        old_logprobs=-3.0 + 0.1 * torch.randn(5, 9, generator=g),
        ref_logprobs=-3.0 + 0.1 * torch.randn(5, 9, generator=g),
    )


@pytest.mark.parametrize("mode", LOSS_AGG_MODES.names)
def test_a_policy_workers_micro_batches_give_the_gradient_of_one_pass(model_dir, mode):
    """The real worker (tiny model, KL term on): micro-batches of 2 rows against one pass."""
    kwargs = dict(
        lr=1e-3,
        seed=0,
        loss_agg_mode=mode,
        loss_scale_factor=L,
        kl_loss_coef=0.1,
        policy_loss="cispo",
    )
    batch = _batch(model_dir)
    grads = []
    for micro in (None, 2):
        worker = PolicyWorker(model_dir, micro_batch_size=micro, **kwargs)
        metrics = worker.forward_backward(batch, batch.counts)
        grads.append(torch.cat([p.grad.reshape(-1) for p in worker.model.parameters()]))  # type: ignore[union-attr]
        assert metrics["policy/num_tokens"] == 16.0  # 6 + 1 + 4 + 0 + 5
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)


def test_the_mode_is_a_config_key_resolved_once_for_the_workers():
    hints = typing.get_type_hints(AlgorithmConfig)
    literal, none = typing.get_args(hints["loss_agg_mode"])  # the registry's names | None
    assert (typing.get_args(literal), none) == (LOSS_AGG_MODES.names, type(None))
    for name in LOSS_AGG_MODES.names:
        assert inspect.isfunction(LOSS_AGG_MODES.get(name))
    with pytest.raises(ConfigError, match=r"loss_agg_mode='sum' has the wrong type|not allowed"):
        load_config(None, ["algorithm.loss_agg_mode=sum"])
    # unset: the loss's own; the norm mode's length defaults to the response budget
    assert policy_kwargs(load_config(None, []))["loss_agg_mode"] == "token-mean"
    gspo = policy_kwargs(load_config(None, ["algorithm.policy_loss=gspo"]))
    assert gspo["loss_agg_mode"] == "seq-mean-token-mean"
    norm = load_config(
        None,
        ["algorithm.loss_agg_mode=seq-mean-token-sum-norm", "generator.sampling.max_tokens=16"],
    )
    assert policy_kwargs(norm)["loss_scale_factor"] == 16  # one turn: the completion's budget
    multi = load_config(None, ["generator.max_turns=3", "generator.max_response_tokens=48"])
    assert multi.generator.response_budget == 48
    assert (
        policy_kwargs(load_config(None, ["algorithm.loss_scale_factor=100"]))["loss_scale_factor"]
        == 100
    )
