"""What a checkpoint is on disk: names, the manifest, the trainer state; reading and checking.

Layout under ``RUN_DIR/checkpoints`` (a ``CheckpointManager``'s ``root``)::

    global_step_4/
        ...                     whatever the ``write`` callback put there (model/, optimizer.pt, ...)
        trainer_state.json      {"step": 4, ...the trainer's dict: dataloader position, config hash}
        manifest.json           sha256 and size of every other file
    global_step_6/
    latest                      "global_step_6\\n", written last
    .tmp-global_step_8-k2j1/    a save in progress, or one a crash left behind

A ``global_step_N`` directory is *complete* when it holds both ``manifest.json`` and
``trainer_state.json``; it is *intact* when ``verify`` finds no problem with it.

This module is read-only except ``write_manifest``, and knows nothing of saving, the
``latest`` pointer or retention (``trainer.checkpoint._manager``) or of listing (``trainer.checkpoint._inspect``);
both import it. Every function blocks.

Errors: ``read_trainer_state`` raises ``CheckpointError``; ``verify`` never raises for a bad
checkpoint, it returns the problems.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any

from trainer.checkpoint._io import files_under, sha256_file, write_text_synced
from trainer.errors import CheckpointError

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "MANIFEST_FORMAT",
    "STEP_DIR_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE_FILE",
    "is_complete",
    "parse_step_dir_name",
    "read_trainer_state",
    "step_dirs",
    "verify",
    "write_manifest",
]

#: A checkpoint directory is ``STEP_DIR_PREFIX + str(step)``.
STEP_DIR_PREFIX = "global_step_"
#: The pointer file in ``root`` naming the checkpoint to resume from.
LATEST_FILE = "latest"
#: JSON written by the manager into every checkpoint: ``step`` plus the trainer's dict.
TRAINER_STATE_FILE = "trainer_state.json"
#: JSON written by the manager into every checkpoint: size and sha256 of every other file.
MANIFEST_FILE = "manifest.json"
#: Entries of ``root`` starting with this are in-progress or abandoned writes.
TMP_PREFIX = ".tmp-"
#: The ``format`` field of ``manifest.json``.
MANIFEST_FORMAT = 1

_STEP_RE = re.compile(re.escape(STEP_DIR_PREFIX) + r"(0|[1-9][0-9]*)")


def parse_step_dir_name(name: str) -> int | None:
    """The ``N`` of a ``global_step_N`` name, or ``None`` for any other name.

    ``N`` is written without sign or leading zeros: ``global_step_07`` is not a step directory.
    """
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m else None


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``global_step_N`` directory in ``root``, lowest step first.

    Complete or not; ``[]`` when ``root`` does not exist.
    """
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = parse_step_dir_name(entry.name)
        if step is not None and entry.is_dir():
            found.append((step, entry))
    return sorted(found)


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds a manifest and a trainer state (not whether the bytes verify)."""
    return (path / MANIFEST_FILE).is_file() and (path / TRAINER_STATE_FILE).is_file()


def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``trainer_state.json`` of the checkpoint at ``path``: ``{"step": N, ...}``.

    Raises ``CheckpointError`` if it is missing, not JSON, not an object, or lacks ``step``.
    """
    file = Path(path) / TRAINER_STATE_FILE
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint") from None
    except (ValueError, OSError) as exc:
        raise CheckpointError(
            f"{file} is unreadable ({exc}); run `python -m trainer ckpt verify {path}`"
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("step"), int):
        raise CheckpointError(f"{file} must be a JSON object with an integer 'step'")
    return data


def write_manifest(directory: Path, step: int) -> int:
    """Write ``directory/manifest.json`` listing size and sha256 of every file under it.

    Each file is fsynced in the same pass that hashes it; the manifest itself is written and
    fsynced last (directories are not: the caller fsyncs them). ``directory`` must not hold a
    manifest yet (it would be listed as a file). Returns the total size in bytes of the files
    listed.
    """
    files = {}
    for path in files_under(directory):
        digest, size = sha256_file(path, fsync=True)
        files[path.relative_to(directory).as_posix()] = {"size": size, "sha256": digest}
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    write_text_synced(directory / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
    return sum(entry["size"] for entry in files.values())


def verify(path: str | os.PathLike[str]) -> list[str]:
    """Problems with the checkpoint at ``path``; an empty list means it is intact.

    Checks: the manifest exists and parses; every file it lists exists with the recorded
    size and sha256; no file was added after the save; ``trainer_state.json`` is listed and
    its ``step`` matches a ``global_step_N`` directory name. Reads every byte once.
    Never raises for a bad checkpoint (that is what the list is for).
    """
    ckpt = Path(path)
    if not ckpt.is_dir():
        return [f"{ckpt} is not a directory"]
    try:
        manifest = json.loads((ckpt / MANIFEST_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return [f"{MANIFEST_FILE} is missing (an interrupted save, or not a checkpoint)"]
    except (ValueError, OSError) as exc:
        return [f"{MANIFEST_FILE} is unreadable: {exc}"]
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        return [f"{MANIFEST_FILE} has no 'files' table"]

    problems = []
    for rel, entry in sorted(files.items()):
        parts = PurePosixPath(rel).parts
        if PurePosixPath(rel).is_absolute() or ".." in parts or not parts:
            problems.append(f"{rel}: path escapes the checkpoint directory")
            continue
        file = ckpt / rel
        if not file.is_file():
            problems.append(f"{rel}: missing")
            continue
        try:
            want_size, want_sha = int(entry["size"]), str(entry["sha256"])
        except (KeyError, TypeError, ValueError):
            problems.append(f"{rel}: malformed manifest entry {entry!r}")
            continue
        size = file.stat().st_size
        if size != want_size:
            problems.append(f"{rel}: size {size} bytes, manifest says {want_size}")
            continue
        if sha256_file(file)[0] != want_sha:
            problems.append(f"{rel}: sha256 differs from the manifest (corrupted or modified)")
    for file in files_under(ckpt):
        rel = file.relative_to(ckpt).as_posix()
        if rel != MANIFEST_FILE and rel not in files:
            problems.append(f"{rel}: not in the manifest (added after the save)")
    if TRAINER_STATE_FILE not in files:
        problems.append(f"{TRAINER_STATE_FILE}: not in the manifest")
    else:
        dir_step = parse_step_dir_name(ckpt.name)
        try:
            step = read_trainer_state(ckpt)["step"]
        except CheckpointError as exc:
            problems.append(str(exc))
        else:
            if dir_step is not None and dir_step != step:
                problems.append(f"{TRAINER_STATE_FILE} says step {step}, directory {ckpt.name}")
    return problems
