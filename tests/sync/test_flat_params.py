"""Rank 0's parameters re-homed into one buffer: what a packed bucket is sent from."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from engines.models import build_tiny_model
from engines.weight_transfer import packed_chunks
from sync.transports.flat_params import bucket_views, current_layout, flatten_parameters
from trainer.checkpoint import load_model, save_model


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(build_tiny_model())


def _packed(bucket: list[tuple[str, torch.Tensor]]) -> torch.Tensor:
    """vLLM's packed bytes of a bucket: each tensor's bytes, back to back."""
    return torch.cat([t.detach().contiguous().view(-1).view(torch.uint8) for _, t in bucket])


def test_flattening_keeps_every_parameter_object_and_value_and_puts_them_in_one_buffer():
    model = _model()
    named = list(model.named_parameters())
    before = {name: (p, p.detach().clone()) for name, p in named}
    flat = flatten_parameters(named)
    assert flat is not None
    assert flat.buffer.numel() == sum(p.numel() * p.element_size() for _, p in named)
    for name, p in model.named_parameters():
        assert p is before[name][0]  # the optimizer's references stay valid
        assert torch.equal(p, before[name][1])
        start, _ = flat.spans[name]
        assert p.data_ptr() == flat.buffer.data_ptr() + start
    assert current_layout(flat, list(model.named_parameters()))


def test_each_bucket_is_a_slice_holding_exactly_vllms_packed_bytes():
    model = _model()
    named = list(model.named_parameters())
    flat = flatten_parameters(named)
    assert flat is not None
    # cut as a packed sync cuts them (vLLM's consumer's chunks)
    sizes = [p.numel() * p.element_size() for _, p in named]
    buckets = [[named[i] for i in chunk] for chunk in packed_chunks(sizes, 64 * 1024)]
    assert len(buckets) > 2
    views = bucket_views(flat, [[name for name, _ in b] for b in buckets])
    assert views is not None and len(views) == len(buckets)
    for view, bucket in zip(views, buckets):
        assert view.untyped_storage().data_ptr() == flat.buffer.untyped_storage().data_ptr()
        assert torch.equal(view, _packed(bucket))
    # names out of buffer order cannot be one slice
    first, second = buckets[0][0][0], buckets[1][0][0]
    assert bucket_views(flat, [[second, first]]) is None


def test_an_optimizer_step_writes_through_to_the_buffer():
    model = _model()
    flat = flatten_parameters(list(model.named_parameters()))
    assert flat is not None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    snapshot = flat.buffer.clone()
    ids = torch.tensor([[1, 2, 3, 4]])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert not torch.equal(flat.buffer, snapshot)
    assert current_layout(flat, list(model.named_parameters()))  # updated in place
    name, p = next(iter(model.named_parameters()))
    start, end = flat.spans[name]
    assert torch.equal(flat.buffer[start:end], _packed([(name, p)]))


def test_a_parameter_given_new_storage_is_noticed_and_re_homed():
    model = _model()
    flat = flatten_parameters(list(model.named_parameters()))
    name, p = list(model.named_parameters())[3]
    p.data = p.data.clone() + 1  # as load_state_dict(assign=True) or a device move would
    named = list(model.named_parameters())
    assert not current_layout(flat, named)
    again = flatten_parameters(named)
    assert again is not None and current_layout(again, named)
    start, end = again.spans[name]
    assert torch.equal(again.buffer[start:end], _packed([(name, p)]))


def test_mixed_dtypes_are_left_as_they_are():
    model = _model()
    params = list(model.named_parameters())
    params[0][1].data = params[0][1].data.to(torch.bfloat16)
    ptrs = [p.data_ptr() for _, p in params]
    assert flatten_parameters(params) is None
    assert [p.data_ptr() for _, p in params] == ptrs
    assert flatten_parameters([]) is None


def test_a_flat_model_checkpoints_and_loads_back_exactly(tmp_path):
    model = _model()
    assert flatten_parameters(list(model.named_parameters())) is not None
    save_model(model, tmp_path / "ckpt")
    fresh = _model()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    load_model(fresh, tmp_path / "ckpt")
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
