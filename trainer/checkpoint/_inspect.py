"""Listing a run's checkpoints for a person: what ``python -m trainer ckpt list`` prints.

The rest of ``ckpt`` needs nothing of its own: ``show`` reads
``trainer.checkpoint._layout.read_trainer_state``, ``verify`` is
``trainer.checkpoint._layout.verify``, and ``prune`` is ``CheckpointManager.prune`` (the same
retention a save applies). Every function blocks.
"""

from __future__ import annotations

import os
from pathlib import Path

import attrs

from trainer.checkpoint._io import files_under
from trainer.checkpoint._layout import MANIFEST_FILE, is_complete, step_dirs
from trainer.checkpoint._manager import CheckpointManager

__all__ = ["CheckpointInfo", "list_checkpoints"]


@attrs.frozen
class CheckpointInfo:
    """One ``global_step_N`` directory, as ``list_checkpoints`` sees it."""

    step: int
    """The step number from the directory name."""
    path: Path
    """The checkpoint directory."""
    size: int
    """Total bytes of every file in it."""
    mtime: float
    """Modification time (epoch seconds) of its manifest, or of the directory without one."""
    is_latest: bool
    """Whether ``CheckpointManager.latest()`` resolves to it (what ``resume_mode=latest`` uses)."""
    complete: bool
    """Whether it has a manifest and trainer state (not whether the bytes verify; see ``verify``)."""


def list_checkpoints(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Every ``global_step_N`` directory under ``root`` (a ``checkpoints`` directory), oldest
    step first; complete or not. ``[]`` when ``root`` does not exist.

    Finding which one is latest may log the warnings of ``CheckpointManager.latest()`` (a
    missing or broken ``latest`` pointer). Reads no checkpoint file's bytes (sizes and
    times only); ``verify`` is what checks them.
    """
    root = Path(root)
    latest = CheckpointManager(root).latest()
    out = []
    for step, path in step_dirs(root):
        files = files_under(path)
        size = sum(f.stat().st_size for f in files if f.is_file())
        manifest = path / MANIFEST_FILE
        mtime = (manifest if manifest.is_file() else path).stat().st_mtime
        out.append(
            CheckpointInfo(
                step=step,
                path=path,
                size=size,
                mtime=mtime,
                is_latest=path == latest,
                complete=is_complete(path),
            )
        )
    return out
