"""The built-in tiny model is one real vLLM can serve on the CPU."""

from __future__ import annotations

import json

from engines.models import build_tiny_model, resolve_model_path


def test_the_tiny_model_has_vllms_cpu_head_size_and_its_own_head(tmp_path):
    cfg = json.loads((build_tiny_model(tmp_path) / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM's CPU attention
    assert cfg["tie_word_embeddings"] is False  # vLLM's CPU reload keeps a tied head stale


def test_an_unset_model_path_is_the_tiny_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))
    assert resolve_model_path(None) == build_tiny_model(tmp_path)
