"""The built-in tiny model and tokenizer, built locally on first use (no hub downloads).

A Qwen2-architecture causal LM with a word-level tokenizer over digits, a few symbols and
words: small enough to train from scratch on two CPU cores in minutes, real enough that
every code path (HF loading, safetensors, generation, weight sync) is the production one.
``model.path`` replaces it with any Hugging Face causal-LM directory, or a GGUF file
(:mod:`engines.gguf_models`).

The build is deterministic from its seed and cached under ``$TRAINER_CACHE_DIR`` (default
``~/.cache/trainer``) in a directory named by a hash of everything that shapes it; it is
written to a temporary directory and renamed, so a crash never leaves a half-built model.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from engines.model_cache import build_directory_atomically
from trainer.errors import ConfigError

__all__ = [
    "TINY_MODEL_CONFIG",
    "WORDS",
    "build_tiny_model",
    "load_tokenizer",
    "quiet_transformers",
    "resolve_model_path",
]

#: Bump when the builder changes what it writes, so stale caches are not reused.
BUILDER_VERSION = 3

#: The tiny model's chat template: ``ROLE : CONTENT <eos>`` per message, then ``assistant :``
#: to prompt a reply. Roles outside the vocabulary (``system``) read as ``<unk>``. A reply's
#: tokens are what follows ``assistant :`` up to and including ``<eos>``, so a conversation
#: that carries the model's replies back re-renders to its earlier prompts plus those tokens
#: (what multi-turn training relies on; see docs/custom_generators.md).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['role'] }} : {{ message['content'] }} {{ eos_token }} "
    "{% endfor -%}"
    "{%- if add_generation_prompt -%}assistant :{%- endif -%}"
)

SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = [
    *[str(d) for d in range(10)],
    *["+", "-", "*", "=", "?", ",", ":", ";", "(", ")", "[", "]", "."],
    *[
        "add",
        "sub",
        "mul",
        "sum",
        "copy",
        "reverse",
        "sort",
        "count",
        "max",
        "min",
        "answer",
        "is",
        "what",
        "the",
        "of",
        "and",
        "to",
        "a",
        "b",
        "c",
    ],
    *["user", "assistant", "tool", "call", "result", "error", "ok", "yes", "no"],
]

#: The built-in model's architecture. vLLM on the CPU serves it: its CPU attention takes head
#: sizes of 32 and up (64 / 2 heads). Its LM head is its own (``build_tiny_model(tied=True)``
#: ties it, for tests of a tied head's sync: ``engines.vllm.tied_head``).
TINY_MODEL_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=256,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def quiet_transformers() -> None:
    """Silence transformers' per-load progress bars and info logs (they garble the run's display)."""
    from transformers.utils import logging as hf_logging  # heavy: only when a model loads

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_warning()


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRAINER_CACHE_DIR", Path.home() / ".cache" / "trainer"))


def _fingerprint(seed: int, cfg: dict[str, Any]) -> str:
    blob = json.dumps(
        {
            "v": BUILDER_VERSION,
            "seed": seed,
            "cfg": cfg,
            "vocab": SPECIAL_TOKENS + WORDS,
            "chat_template": CHAT_TEMPLATE,
        },
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _build_tokenizer():
    # heavy (tokenizers, torch, transformers): only when a model is built or loaded
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    tok.post_processor = processors.TemplateProcessing(single="$A", special_tokens=[])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(cache_dir: Path | None = None, seed: int = 0, *, tied: bool = False) -> Path:
    """Return the directory of the built-in tiny model, building it on first use.

    ``tied``: the same architecture with its LM head tied to its embeddings (as most small
    pretrained models have it), for tests of the tied head's sync.
    """
    model_cfg = {**TINY_MODEL_CONFIG, "tie_word_embeddings": True} if tied else TINY_MODEL_CONFIG
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache_dir / f"tiny-qwen2-{_fingerprint(seed, model_cfg)}"
    if (target / "config.json").exists():
        return target  # before the imports below: they take seconds
    import torch  # heavy: see _build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    quiet_transformers()
    tokenizer = _build_tokenizer()
    cfg = Qwen2Config(
        vocab_size=len(tokenizer),
        pad_token_id=int(tokenizer.pad_token_id),  # type: ignore[arg-type]
        eos_token_id=int(tokenizer.eos_token_id),  # type: ignore[arg-type]
        bos_token_id=int(tokenizer.bos_token_id),  # type: ignore[arg-type]
        **model_cfg,
    )
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)

    def build(tmp: Path) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # Without this, AutoTokenizer maps model_type=qwen2 to Qwen2's BPE tokenizer class.
        tok_cfg_path = tmp / "tokenizer_config.json"
        tok_cfg = json.loads(tok_cfg_path.read_text())
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))

    return build_directory_atomically(target, build)


def resolve_model_path(path: str | None, seed: int = 0) -> Path:
    """The model directory of ``model.path``: a Hugging Face directory (checked), a GGUF file
    or the short name of a packaged one (converted once, :mod:`engines.gguf_models`), or
    unset, the built-in tiny model. Blocking (a first conversion takes seconds)."""
    if path is None:
        return build_tiny_model(seed=seed)
    from engines.gguf_models import PACKAGED, converted_gguf, gguf_source

    source = gguf_source(path)
    if source is not None:
        return converted_gguf(source, default_cache_dir())
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"model.path={path!r} is not a Hugging Face model directory (no config.json), a "
            f".gguf file or a packaged model ({', '.join(PACKAGED)}); pass one, or leave "
            "model.path unset for the built-in tiny model"
        )
    return p


def load_tokenizer(path: str | Path):
    """The tokenizer of a model directory, exactly as its ``tokenizer.json`` defines it.

    transformers 5's ``AutoTokenizer`` picks a tokenizer class from the model type (a
    ``qwen2`` model gets Qwen2's BPE class even when ``tokenizer.json`` holds another
    model); reading ``tokenizer.json`` directly is faithful for every fast tokenizer.
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # heavy

    quiet_transformers()
    path = Path(path)
    if (path / "tokenizer.json").is_file():
        tok = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok
