"""A LoRA policy's part of a checkpoint: a peft adapter directory and the identity of its base.

``policy/`` of a LoRA run's checkpoint is what peft's ``save_pretrained`` writes
(``adapter_config.json``, ``adapter_model.safetensors``), loadable as it is with
``PeftModel.from_pretrained(base, "policy/")`` and by vLLM's ``--lora-modules`` or
``/v1/load_lora_adapter``, plus :data:`BASE_FILE`: the base model's directory and a digest of
its weights. A resume checks the digest against the base it is given (the adapter is a
difference from one model's weights: on another it is noise) and the adapter's shape against
``model.lora``. Every function blocks: call them from a worker thread or process.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.errors import CheckpointError

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "BASE_FILE",
    "check_adapter_shape",
    "is_adapter_dir",
    "read_base",
    "weights_digest",
    "write_base",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: ``{"model_dir": ..., "digest": ...}``: the frozen model the adapter was trained on.
BASE_FILE = "lora_base.json"


def is_adapter_dir(directory: Path) -> bool:
    """Whether ``directory`` holds a peft adapter (a LoRA run's ``policy/``)."""
    return (Path(directory) / ADAPTER_CONFIG).is_file()


def weights_digest(named: Iterable[tuple[str, torch.Tensor]]) -> str:
    """sha256 over each tensor's name and float32 bytes, in name order: the same for the same
    weights whatever their dtype was widened from, their device or the order given."""
    h = hashlib.sha256()
    for name, tensor in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def write_base(directory: Path, model_dir: str, digest: str) -> None:
    """Record the base model (its directory and :func:`weights_digest`) beside the adapter."""
    body = json.dumps({"model_dir": model_dir, "digest": digest}, indent=2) + "\n"
    (Path(directory) / BASE_FILE).write_text(body)


def read_base(directory: Path) -> dict[str, str]:
    """What :func:`write_base` recorded in ``directory``; ``CheckpointError`` if it is missing."""
    path = Path(directory) / BASE_FILE
    try:
        body: dict[str, str] = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{directory} holds a LoRA adapter but no {BASE_FILE}: the checkpoint does not say "
            "which base model the adapter belongs to"
        ) from None
    return body


def check_adapter_shape(directory: Path, wanted: Mapping[str, Any]) -> None:
    """``CheckpointError`` where ``directory``'s ``adapter_config.json`` differs from ``wanted``
    (``r``, ``lora_alpha``, ``target_modules`` as peft writes them), naming both."""
    saved = json.loads((Path(directory) / ADAPTER_CONFIG).read_text())
    diffs = [
        f"{key}: checkpoint {saved.get(key)!r}, this run {value!r}"
        for key, value in wanted.items()
        if _normal(saved.get(key)) != _normal(value)
    ]
    if diffs:
        raise CheckpointError(
            f"the adapter in {directory} is not the one model.lora describes ("
            + "; ".join(diffs)
            + "): resume with the checkpoint's model.lora settings"
        )


def _normal(value: object) -> object:
    """Lists and sets compare as sorted lists, numbers as floats."""
    if isinstance(value, list | tuple | set):
        return sorted(str(v) for v in value)
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value
