"""``python -m trainer ckpt export DIR OUT``: a checkpoint's policy as a model you can serve.

OUT is a Hugging Face model directory (``config.json``, safetensors, the tokenizer and its chat
template) that ``AutoModelForCausalLM.from_pretrained``, ``AutoTokenizer`` and ``vllm serve``
load. A fully fine-tuned policy's ``policy/`` already is one: it is copied. A LoRA policy's is
a peft adapter: it is merged into its base model (the directory the checkpoint records, or
``--base``; its weights must be the ones the adapter was trained on) with peft's
``merge_and_unload``, in float32, and saved in the base's own dtype. ``--adapter`` writes the
adapter itself instead (``PeftModel.from_pretrained(base, OUT)``, vLLM's ``--lora-modules``).

OUT is written beside itself and renamed into place: it is whole or absent. Blocking.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from trainer.checkpoint._io import save_model
from trainer.checkpoint._lora import BASE_FILE, is_adapter_dir, read_base, weights_digest
from trainer.checkpoint._manager import POLICY_DIR, copy_tokenizer_files
from trainer.errors import CheckpointError

__all__ = ["export_policy"]


def export_policy(
    checkpoint: Path, out: Path, *, adapter: bool = False, base: Path | None = None
) -> str:
    """Write ``checkpoint``'s policy to ``out`` (see the module docstring); what was written,
    in words. ``CheckpointError`` for an ``out`` that exists, ``--adapter`` of a fully
    fine-tuned policy, or a base model that is missing or not the adapter's."""
    policy = Path(checkpoint) / POLICY_DIR
    out = Path(out)
    if out.exists():
        raise CheckpointError(f"{out} already exists: export into a new directory")
    lora = is_adapter_dir(policy)
    if adapter and not lora:
        raise CheckpointError(
            f"{checkpoint} holds a fully fine-tuned policy, not a LoRA adapter: export it "
            "without --adapter"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        if not lora or adapter:
            shutil.copytree(policy, tmp, dirs_exist_ok=True)
            (tmp / BASE_FILE).unlink(missing_ok=True)
            what = "the LoRA adapter (peft)" if lora else "the policy"
        else:
            base_dir = _merge(policy, tmp, base)
            what = f"the policy merged into its base model {base_dir}"
        _as_created(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return what


def _umask() -> int:
    """This process's umask, read without changing it (``os.umask`` sets it); 0o022 where
    ``/proc`` does not say."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _as_created(tree: Path) -> None:
    """The modes a directory and files made afresh would have (the checkpoint's private
    0600 files and the temporary directory's 0700 would keep another user, a server's, out)."""
    umask = _umask()
    tree.chmod(0o777 & ~umask)
    for path in tree.rglob("*"):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _merge(adapter_dir: Path, out: Path, base: Path | None) -> Path:
    """The adapter of ``adapter_dir`` merged into its base, saved in ``out``; the base's path."""
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no carriage returns in a log
    recorded = read_base(adapter_dir)
    base_dir = Path(base) if base is not None else Path(recorded["model_dir"])
    if not (base_dir / "config.json").is_file():
        raise CheckpointError(
            f"the adapter's base model {str(base_dir)!r} is not a model directory here: pass "
            "--base DIR (the model the run trained, as a Hugging Face directory)"
        )
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if weights_digest(model.named_parameters()) != recorded["digest"]:
        raise CheckpointError(
            f"{base_dir} is not the model the adapter in {adapter_dir} was trained on (its "
            "weights differ): pass --base with that model's directory"
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers' old names
        merged = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    stored = getattr(AutoConfig.from_pretrained(base_dir), "dtype", None) or torch.float32
    merged.to(stored if isinstance(stored, torch.dtype) else getattr(torch, str(stored)))
    save_model(merged, out)
    copy_tokenizer_files(adapter_dir, out)
    copy_tokenizer_files(base_dir, out)  # what the adapter directory lacks
    generation = base_dir / "generation_config.json"
    if generation.is_file() and not (out / generation.name).exists():
        shutil.copyfile(generation, out / generation.name)
    return base_dir
