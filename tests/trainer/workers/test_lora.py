"""LoRA policies (``model.lora``): only the adapter trains, the weight transports read the
merged weights by the base model's names, and a checkpoint holds the adapter and its base's
identity (a resume on another base, or with another adapter shape, is refused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.helpers import random_batch
from trainer.errors import CheckpointError
from trainer.workers.lora import LoraSpec, MergedWeights, add_adapter, base_parameters
from trainer.workers.policy import PolicyWorker, _load_model

SPEC = LoraSpec(rank=4, alpha=8, target_modules=("q_proj", "v_proj", "down_proj"))


def _policy(model_dir: Path, spec: LoraSpec | None = SPEC, **kwargs) -> PolicyWorker:
    return PolicyWorker(model_dir, lr=1e-2, seed=0, lora=spec, **kwargs)


def _step(policy: PolicyWorker, model_dir: Path, seed: int) -> None:
    policy.forward_backward(random_batch(model_dir, 4, seed=seed))
    policy.optim_step()


@pytest.fixture
def policy(model_dir):
    return _policy(model_dir)


def test_the_merged_weights_are_the_base_plus_alpha_over_r_times_b_a_by_the_base_names(model_dir):
    model = add_adapter(_load_model(model_dir, torch.device("cpu"), torch.float32), SPEC)
    base = _load_model(model_dir, torch.device("cpu"), torch.float32)
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    out_features, in_features = layer.base_layer.weight.shape
    with torch.no_grad():  # hand-set factors: B A is [[1, 0, ...], ...] times known numbers
        layer.lora_A["default"].weight.zero_()
        layer.lora_B["default"].weight.zero_()
        layer.lora_A["default"].weight[0, 1] = 3.0
        layer.lora_B["default"].weight[2, 0] = 0.5
    merged = dict(MergedWeights(model).fresh().named_parameters())

    assert list(merged) == [n for n, _ in base.named_parameters()]  # the engines' names, in order
    want = base.model.layers[0].self_attn.q_proj.weight.clone()
    want[2, 1] += (8 / 4) * 0.5 * 3.0  # alpha / r * B[2, 0] * A[0, 1]
    torch.testing.assert_close(
        merged["model.layers.0.self_attn.q_proj.weight"], want, rtol=0, atol=0
    )
    assert (out_features, in_features) == tuple(want.shape)
    # a layer without an adapter is the base's own tensor (no copy)
    k_proj = merged["model.layers.0.self_attn.k_proj.weight"]
    assert k_proj.data_ptr() == layer_of(model, "k_proj").weight.data_ptr()
    for name, p in base.named_parameters():
        if name != "model.layers.0.self_attn.q_proj.weight":
            torch.testing.assert_close(merged[name], p, rtol=0, atol=0, msg=name)


def layer_of(model: torch.nn.Module, name: str) -> torch.nn.Module:
    return getattr(model.get_base_model().model.layers[0].self_attn, name)


def test_only_the_adapter_trains_and_the_merged_weights_follow_each_step(policy, model_dir):
    base_before = {n: p.clone() for n, p in base_parameters(policy.model)}
    trained = [n for n, p in policy.model.named_parameters() if p.requires_grad]
    assert trained and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert len(policy.optimizer.param_groups[0]["params"]) == len(trained)

    merged_0 = {n: p.clone() for n, p in policy.readable_model().named_parameters()}
    _step(policy, model_dir, seed=1)
    merged_1 = dict(policy.readable_model().named_parameters())

    for name, p in base_parameters(policy.model):
        assert torch.equal(p, base_before[name]), f"the frozen {name} moved"
    changed = {n for n in merged_1 if not torch.equal(merged_1[n], merged_0[n])}
    adapted = {
        f"model.layers.{i}.{m}.weight"
        for i in range(2)
        for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
    }
    assert changed == adapted  # B moved off zero in every adapted layer, nothing else changed
    # the merged weights score what the policy scores (the sync check's comparison)
    ids = torch.tensor([[1, 5, 9, 12, 4]])
    with torch.no_grad():
        through_adapter = policy.model(ids).logits
        base = _load_model(model_dir, torch.device("cpu"), torch.float32)
        base.load_state_dict(merged_1)
        through_merged = base(ids).logits
    torch.testing.assert_close(through_merged, through_adapter, rtol=0, atol=1e-5)


def test_a_checkpoint_holds_the_adapter_alone_and_resumes_it_exactly(policy, model_dir, tmp_path):
    _step(policy, model_dir, seed=1)
    policy.save_checkpoint(tmp_path)
    files = sorted(p.name for p in (tmp_path / "policy").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors", "lora_base.json"} <= set(files)
    assert "model.safetensors" not in files
    state = torch.load(tmp_path / "optimizer.pt", weights_only=True)["state"]
    assert len(state) == sum(p.requires_grad for p in policy.model.parameters())

    resumed = _policy(model_dir)
    resumed.load_checkpoint(tmp_path)
    _step(policy, model_dir, seed=2)
    _step(resumed, model_dir, seed=2)
    for (name, a), (_, b) in zip(
        policy.readable_model().named_parameters(), resumed.readable_model().named_parameters()
    ):
        assert torch.equal(a, b), f"{name} differs after the resume"


def test_a_resume_on_another_base_or_with_another_rank_is_refused(policy, model_dir, tmp_path):
    policy.save_checkpoint(tmp_path)
    record = tmp_path / "policy" / "lora_base.json"
    body = json.loads(record.read_text())
    record.write_text(json.dumps({**body, "digest": "0" * 64}))
    with pytest.raises(CheckpointError, match="whose weights differ from this run's base"):
        _policy(model_dir).load_checkpoint(tmp_path)
    record.write_text(json.dumps(body))
    with pytest.raises(CheckpointError, match=r"r: checkpoint 4, this run 8"):
        _policy(
            model_dir, LoraSpec(rank=8, alpha=8, target_modules=SPEC.target_modules)
        ).load_checkpoint(tmp_path)


def test_target_modules_that_match_no_layer_name_the_models_linear_layers(model_dir):
    model = _load_model(model_dir, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match=r"its linear layers are named \[.*'q_proj'"):
        add_adapter(model, LoraSpec(rank=4, target_modules=("query_key_value",)))
