"""Checkpoints: the atomic writer and its retention (:class:`CheckpointManager`), the on-disk
format, model and state files, and ``python -m trainer ckpt`` (:func:`ckpt_main`).

The workers import :mod:`trainer.checkpoint.format` (their files and ``SaveCheckpoint``), never
this face: which checkpoint is written and kept is the run's decision."""

from trainer.checkpoint._cli import ckpt_main as ckpt_main
from trainer.checkpoint._io import load_model as load_model
from trainer.checkpoint._io import load_state as load_state
from trainer.checkpoint._io import remove_folder_atomically as remove_folder_atomically
from trainer.checkpoint._io import rng_state as rng_state
from trainer.checkpoint._io import save_model as save_model
from trainer.checkpoint._io import save_state as save_state
from trainer.checkpoint._io import set_rng_state as set_rng_state
from trainer.checkpoint._io import write_folder_atomically as write_folder_atomically
from trainer.checkpoint._layout import LATEST_FILE as LATEST_FILE
from trainer.checkpoint._layout import MANIFEST_FILE as MANIFEST_FILE
from trainer.checkpoint._layout import STEP_DIR_PREFIX as STEP_DIR_PREFIX
from trainer.checkpoint._layout import TMP_PREFIX as TMP_PREFIX
from trainer.checkpoint._layout import TRAINER_STATE_FILE as TRAINER_STATE_FILE
from trainer.checkpoint._manager import RESUME_MODES as RESUME_MODES
from trainer.checkpoint._manager import CheckpointManager as CheckpointManager
from trainer.errors import CheckpointError as CheckpointError

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "RESUME_MODES",
    "STEP_DIR_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "CheckpointManager",
    "ckpt_main",
    "load_model",
    "load_state",
    "remove_folder_atomically",
    "rng_state",
    "save_model",
    "save_state",
    "set_rng_state",
    "write_folder_atomically",
]
