"""The built-in tiny model and its copy that vLLM can serve on the CPU."""

from __future__ import annotations

import json

import pytest

from engines.models import TINY_VLLM, build_tiny_model, resolve_model_path


def _config(path) -> dict:
    return json.loads((path / "config.json").read_text())


def test_the_vllm_variant_has_vllms_cpu_head_size_and_its_own_head(tmp_path):
    vllm = build_tiny_model(tmp_path, variant="vllm")
    cfg = _config(vllm)
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM's CPU attention
    assert cfg["tie_word_embeddings"] is False  # vLLM's CPU reload keeps a tied head stale
    default = _config(build_tiny_model(tmp_path))
    assert default["tie_word_embeddings"] is True  # the default is not changed (yet)
    assert {
        k: v
        for k, v in cfg.items()
        if k not in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    } == {
        k: v
        for k, v in default.items()
        if k not in ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
    }


def test_model_path_names_the_vllm_variant(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))
    assert resolve_model_path(TINY_VLLM) == build_tiny_model(tmp_path, variant="vllm")
    with pytest.raises(ValueError, match="unknown tiny-model variant"):
        build_tiny_model(tmp_path, variant="huge")
