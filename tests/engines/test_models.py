"""The built-in tiny model is one real vLLM can serve on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engines import model_cache
from engines.models import build_tiny_model, resolve_model_path


def test_the_tiny_model_has_vllms_cpu_head_size_and_its_own_head(tmp_path):
    cfg = json.loads((build_tiny_model(tmp_path) / "config.json").read_text())
    assert cfg["hidden_size"] // cfg["num_attention_heads"] >= 32  # vLLM's CPU attention
    assert cfg["tie_word_embeddings"] is False  # its measured curves were made untied


def test_a_tied_tiny_model_is_its_own_directory_storing_the_head_once(tmp_path):
    from safetensors import safe_open

    tied = build_tiny_model(tmp_path, tied=True)
    assert tied != build_tiny_model(tmp_path)
    assert json.loads((tied / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(tied / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert not list(tmp_path.glob(".build-*"))  # built into a temporary directory, renamed


def test_an_unset_model_path_is_the_tiny_model(monkeypatch, tmp_path):
    monkeypatch.setenv("TRAINER_CACHE_DIR", str(tmp_path))
    assert resolve_model_path(None) == build_tiny_model(tmp_path)


def test_a_builder_waits_a_bound_for_another_process_building_the_same_directory(
    tmp_path, monkeypatch
):
    target = tmp_path / "model"
    lock = tmp_path / ".model.lock"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, filelock; l = filelock.FileLock(sys.argv[1]); l.acquire(); "
            "print('held', flush=True); sys.stdin.read()",
            str(lock),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        monkeypatch.setattr(model_cache, "LOCK_TIMEOUT_S", 0.5)
        with pytest.raises(TimeoutError, match="another process has been building"):
            model_cache.build_directory_atomically(target, lambda tmp: None)
    finally:
        holder.communicate("", timeout=30)  # end of input: the holder exits, the lock goes
    built = model_cache.build_directory_atomically(
        target, lambda tmp: (tmp / "config.json").write_text("{}")
    )
    assert (built / "config.json").is_file() and not list(tmp_path.glob(".build-*"))
