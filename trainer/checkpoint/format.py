"""The checkpoint format as the workers write and read it, and nothing that decides the run.

A worker's part of a checkpoint is its files: the model (``save_model``/``load_model``,
safetensors in a Hugging Face-loadable directory), the optimizer and scheduler
(``save_state``/``load_state``, ``torch.load(weights_only=True)``) and the RNG state
(``rng_state``/``set_rng_state``); a LoRA policy's adapter directory and the identity of its
base (:mod:`trainer.checkpoint._lora`). Which step is saved, the atomic write around the files,
the ``latest`` pointer and retention are the run's (``trainer.checkpoint.CheckpointManager``):
a worker group is handed the manager's ``save`` as a :data:`SaveCheckpoint` and calls it with
its writer. Every function blocks: call them from a worker thread or process.

The workers import this module, never the package's face (lint-imports keeps it so).
"""

from collections.abc import Callable
from pathlib import Path
from typing import TypeAlias

from trainer.checkpoint._io import load_model as load_model
from trainer.checkpoint._io import load_state as load_state
from trainer.checkpoint._io import rng_state as rng_state
from trainer.checkpoint._io import save_model as save_model
from trainer.checkpoint._io import save_state as save_state
from trainer.checkpoint._io import set_rng_state as set_rng_state
from trainer.checkpoint._lora import ADAPTER_WEIGHTS as ADAPTER_WEIGHTS
from trainer.checkpoint._lora import BASE_FILE as BASE_FILE
from trainer.checkpoint._lora import check_adapter_shape as check_adapter_shape
from trainer.checkpoint._lora import is_adapter_dir as is_adapter_dir
from trainer.checkpoint._lora import read_base as read_base
from trainer.checkpoint._lora import weights_digest as weights_digest
from trainer.checkpoint._lora import write_base as write_base

__all__ = [
    "ADAPTER_WEIGHTS",
    "BASE_FILE",
    "SaveCheckpoint",
    "check_adapter_shape",
    "is_adapter_dir",
    "load_model",
    "load_state",
    "read_base",
    "rng_state",
    "save_model",
    "save_state",
    "set_rng_state",
    "weights_digest",
    "write_base",
]

#: ``save(step, write, trainer_state) -> directory``: ``CheckpointManager.save``'s shape.
#: ``write(tmp)`` puts the worker's files into the checkpoint's temporary directory; the
#: manager adds the trainer state and the manifest, and installs the directory atomically.
SaveCheckpoint: TypeAlias = Callable[[int, Callable[[Path], None], dict[str, object]], Path]
