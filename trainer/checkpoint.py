"""Atomic checkpoints: save, resume, retention (DESIGN 4.6 and 5).

Layout under ``RUN_DIR/checkpoints`` (the manager's ``root``)::

    global_step_4/
        ...                     whatever the ``write`` callback put there (model/, optimizer.pt, ...)
        trainer_state.json      {"step": 4, ...the trainer's dict: dataloader position, config hash}
        manifest.json           sha256 and size of every other file
    global_step_6/
    latest                      "global_step_6\\n", written last
    .tmp-global_step_8-k2j1/    a save in progress, or one a crash left behind

How a save stays atomic: everything is written into a ``.tmp-*`` directory, every file and
directory is fsynced, the directory is renamed to ``global_step_N`` (a rename within one
file system is atomic), the root is fsynced, and only then is ``latest`` replaced (a temp
file, fsync, ``os.replace``, fsync of the root). A crash at any point leaves either the old
``latest`` pointing at an old complete checkpoint, or the new one at a new complete one;
leftover ``.tmp-*`` entries are removed by the next save. A ``global_step_N`` directory only
ever appears complete, so if ``latest`` is lost (a crash between the rename and the pointer
write) the highest step directory is a safe fallback.

Loading never unpickles arbitrary objects: weights are safetensors, other state goes through
``torch.load(weights_only=True)``, trainer state is JSON.

Two sides:

- Worker side (blocking, in a worker thread or process): ``save_model``/``load_model``,
  ``save_state``/``load_state``, ``rng_state``/``set_rng_state`` (in ``trainer.checkpoint_io``,
  re-exported here).
- Driver side: ``CheckpointManager`` (its methods block too: the loop calls ``save`` through
  ``trio.to_thread.run_sync`` inside ``operation("save_checkpoint")``).

One writer per ``root``: a save removes every ``.tmp-*`` entry it finds, including one a
concurrent writer would be using. Directory fsync is POSIX-only.

Errors: ``CheckpointError(RuntimeError)`` for a checkpoint that is missing, incomplete,
corrupted, or holds something this module refuses to load; ``ValueError`` for bad arguments.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    pass

from trainer.checkpoint_io import (
    files_under,
    fsync_dir,
    load_model,
    load_state,
    remove_path,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
    sha256_file,
    write_text_synced,
)
from trainer.errors import CheckpointError

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "STEP_DIR_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointManager",
    "load_model",
    "load_state",
    "rng_state",
    "save_model",
    "save_state",
    "set_rng_state",
]

logger = logging.getLogger(__name__)

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
#: The allowed values of ``trainer.resume_mode``.
RESUME_MODES: tuple[str, ...] = ("none", "latest", "path")
MANIFEST_FORMAT = 1

_STEP_RE = re.compile(re.escape(STEP_DIR_PREFIX) + r"(0|[1-9][0-9]*)")


# --------------------------------------------------------------------------- driver side


@attrs.frozen
class CheckpointInfo:
    """One ``global_step_N`` directory, as ``CheckpointManager.list`` sees it."""

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


def _check_max_to_keep(_inst: object, _attr: object, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or value < 1):
        raise ValueError(f"max_to_keep must be None (keep every checkpoint) or >= 1, got {value!r}")


@attrs.define(eq=False)
class CheckpointManager:
    """Saves, finds, verifies and prunes the checkpoints of one run; every method blocks.

    Usage from the step loop::

        ckpt = CheckpointManager(run_dir / "checkpoints", max_to_keep=cfg.trainer.max_ckpts_to_keep)
        start = ckpt.resolve(cfg.trainer.resume_mode, cfg.trainer.resume_path)  # None: fresh
        if start is not None:
            state = ckpt.read_trainer_state(start)  # {"step": N, ...}
        ...
        with operation("save_checkpoint"):
            await trio.to_thread.run_sync(ckpt.save, step, workers.write_checkpoint, state)
    """

    root: Path = attrs.field(converter=Path)
    """``RUN_DIR/checkpoints``; created by the first save."""
    max_to_keep: int | None = attrs.field(default=None, validator=_check_max_to_keep)
    """How many checkpoints a save keeps (newest steps, plus whatever ``latest`` names); None keeps all."""

    def step_dir(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return self.root / f"{STEP_DIR_PREFIX}{step}"

    # ----------------------------------------------------------------- save

    def save(self, step: int, write: Callable[[Path], None], trainer_state: dict) -> Path:
        """Write the checkpoint of ``step`` atomically and point ``latest`` at it; blocking.

        Order: remove stale ``.tmp-*`` entries; ``write(tmp)`` (the workers write model,
        optimizer, scheduler, RNG state into the temp directory); write ``trainer_state.json``
        (``{"step": step, **trainer_state}``) and ``manifest.json``; fsync every file and
        directory; rename to ``global_step_N``; fsync ``root``; replace ``latest``; prune to
        ``max_to_keep``. Returns the checkpoint directory.

        An existing ``global_step_N`` (a re-save of the same step) is moved aside, replaced
        and deleted; a crash in that short window leaves no ``global_step_N``, and ``latest()``
        falls back to the highest complete step.

        If anything raises (``write`` included), the temp directory is removed, ``latest`` and
        every existing checkpoint are untouched, and the error propagates.

        Raises ``ValueError`` for a negative step, a ``trainer_state`` that is not JSON
        (``nan`` included) or whose ``"step"`` disagrees with ``step``, before writing
        anything; ``CheckpointError`` if ``write`` created a file the manager owns.
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if "step" in trainer_state and trainer_state["step"] != step:
            raise ValueError(
                f"trainer_state['step'] is {trainer_state['step']!r} but the checkpoint is for "
                f"step {step}; leave 'step' out (the manager records it)"
            )
        try:
            state_json = json.dumps(
                {**trainer_state, "step": step}, indent=2, sort_keys=True, allow_nan=False
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(
                f"trainer_state must be JSON-serializable (str keys; str, int, float without "
                f"nan/inf, bool, None, lists, dicts): {exc}"
            ) from None

        started = time.monotonic()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()
        final = self.step_dir(step)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root))
        try:
            write(tmp)
            for owned in (TRAINER_STATE_FILE, MANIFEST_FILE):
                if (tmp / owned).exists():
                    raise CheckpointError(
                        f"the checkpoint writer created {owned}, which CheckpointManager owns; "
                        "pass trainer state in the trainer_state dict instead"
                    )
            write_text_synced(tmp / TRAINER_STATE_FILE, state_json + "\n")
            files = {}
            for path in files_under(tmp):
                digest, size = sha256_file(path, fsync=True)
                files[path.relative_to(tmp).as_posix()] = {"size": size, "sha256": digest}
            manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
            write_text_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
            for dirpath, _dirs, _files in os.walk(tmp, topdown=False):
                fsync_dir(Path(dirpath))
            self._install(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_latest(final.name)
        total = sum(entry["size"] for entry in files.values())
        logger.info(
            "saved checkpoint %s (%.1f MB) in %.2fs",
            final,
            total / 1e6,
            time.monotonic() - started,
        )
        if self.max_to_keep is not None:
            self.prune(self.max_to_keep)
        return final

    def _install(self, tmp: Path, final: Path) -> None:
        old = None
        if final.exists():
            old = self.root / f"{TMP_PREFIX}replaced-{final.name}-{secrets.token_hex(4)}"
            os.rename(final, old)
        os.rename(tmp, final)
        fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}-{secrets.token_hex(4)}"
        try:
            write_text_synced(tmp, name + "\n")
            os.replace(tmp, self.root / LATEST_FILE)
        except BaseException:
            remove_path(tmp)
            raise
        fsync_dir(self.root)

    def _remove_stale_tmp(self) -> None:
        for entry in sorted(self.root.glob(f"{TMP_PREFIX}*")):
            logger.warning("removing %s, left behind by an interrupted checkpoint write", entry)
            remove_path(entry)

    # ----------------------------------------------------------------- find

    def _step_dirs(self) -> builtins.list[tuple[int, Path]]:
        if not self.root.is_dir():
            return []
        found = []
        for entry in self.root.iterdir():
            m = _STEP_RE.fullmatch(entry.name)
            if m and entry.is_dir():
                found.append((int(m.group(1)), entry))
        return sorted(found)

    @staticmethod
    def _is_complete(path: Path) -> bool:
        return (path / MANIFEST_FILE).is_file() and (path / TRAINER_STATE_FILE).is_file()

    def latest(self) -> Path | None:
        """The checkpoint ``latest`` points at, or ``None`` when there is no checkpoint at all.

        If the pointer is missing, unreadable, malformed, or names a directory that is not a
        complete checkpoint, falls back to the highest complete ``global_step_N`` and logs a
        warning (a crash between the rename and the pointer write leaves exactly this). Does
        not verify checksums; ``resolve`` does.
        """
        pointer = self.root / LATEST_FILE
        try:
            text: str | None = pointer.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            text = None
        except (OSError, UnicodeDecodeError) as exc:
            text = f"<unreadable: {exc}>"
        complete = [p for _, p in self._step_dirs() if self._is_complete(p)]
        if text is not None:
            if _STEP_RE.fullmatch(text) and self._is_complete(self.root / text):
                return self.root / text
            problem = f"{pointer} holds {text!r}, which is not a complete checkpoint"
        else:
            problem = f"{pointer} is missing"
        if not complete:
            if text is not None:
                logger.warning("%s, and there is no complete checkpoint to fall back to", problem)
            return None
        logger.warning("%s; falling back to the highest complete step, %s", problem, complete[-1])
        return complete[-1]

    def resolve(
        self,
        resume_mode: Literal["none", "latest", "path"],
        resume_path: str | os.PathLike[str] | None = None,
        *,
        verify: bool = True,
    ) -> Path | None:
        """The checkpoint to resume from, per ``trainer.resume_mode``; ``None`` = start fresh.

        - ``"none"``: ``None`` (``resume_path`` is ignored).
        - ``"latest"``: ``latest()``; ``None`` when the run has no checkpoint yet.
        - ``"path"``: ``resume_path``, which must be one complete checkpoint directory
          (``.../checkpoints/global_step_N``), anywhere.

        With ``verify`` (the default) the chosen checkpoint's files are checked against its
        manifest (reads every byte once). Raises ``ValueError`` for an unknown mode (naming
        the allowed ones) or ``"path"`` without ``resume_path``; ``CheckpointError`` naming
        the path and the problems when the checkpoint is missing, incomplete or corrupted.
        """
        if resume_mode == "none":
            return None
        if resume_mode == "latest":
            found = self.latest()
            if found is None:
                logger.info("no checkpoint under %s; starting from scratch", self.root)
                return None
        elif resume_mode == "path":
            if resume_path is None or str(resume_path) == "":
                raise ValueError(
                    "trainer.resume_mode=path needs trainer.resume_path=DIR, a "
                    "checkpoints/global_step_N directory"
                )
            found = Path(resume_path).expanduser()
            if not found.is_dir():
                what = "is not a directory" if found.exists() else "does not exist"
                raise CheckpointError(
                    f"trainer.resume_path={str(resume_path)!r} {what}; point it at a "
                    "checkpoints/global_step_N directory"
                )
            if not self._is_complete(found):
                hint = (
                    "it looks like a run or checkpoints directory: point at one "
                    "global_step_N inside it, or use trainer.resume_mode=latest"
                    if (found / LATEST_FILE).exists() or (found / "checkpoints").is_dir()
                    else "an interrupted save, or not a checkpoint directory"
                )
                raise CheckpointError(
                    f"trainer.resume_path={str(resume_path)!r} is not a complete checkpoint "
                    f"(no {MANIFEST_FILE} or {TRAINER_STATE_FILE}): {hint}"
                )
        else:
            raise ValueError(
                f"unknown resume_mode {resume_mode!r}; allowed: {', '.join(RESUME_MODES)}"
            )
        if verify:
            problems = self.verify(found)
            if problems:
                raise CheckpointError(
                    f"checkpoint {found} failed verification: {'; '.join(problems[:5])}"
                    + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else "")
                    + ". Resume from another one with trainer.resume_mode=path "
                    "trainer.resume_path=DIR (see `python -m trainer ckpt list`)."
                )
        return found

    @staticmethod
    def read_trainer_state(path: str | os.PathLike[str]) -> dict[str, Any]:
        """The ``trainer_state.json`` of the checkpoint at ``path``: ``{"step": N, ...}``.

        Raises ``CheckpointError`` if it is missing, not JSON, not an object, or lacks ``step``.
        """
        file = Path(path) / TRAINER_STATE_FILE
        try:
            data = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CheckpointError(
                f"{file} is missing: {path} is not a complete checkpoint"
            ) from None
        except (ValueError, OSError) as exc:
            raise CheckpointError(
                f"{file} is unreadable ({exc}); run `python -m trainer ckpt verify {path}`"
            ) from None
        if not isinstance(data, dict) or not isinstance(data.get("step"), int):
            raise CheckpointError(f"{file} must be a JSON object with an integer 'step'")
        return data

    def list(self) -> builtins.list[CheckpointInfo]:
        """Every ``global_step_N`` directory under ``root``, oldest step first."""
        latest = self.latest()
        out = []
        for step, path in self._step_dirs():
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
                    complete=self._is_complete(path),
                )
            )
        return out

    @staticmethod
    def verify(path: str | os.PathLike[str]) -> builtins.list[str]:
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
            m = _STEP_RE.fullmatch(ckpt.name)
            try:
                step = CheckpointManager.read_trainer_state(ckpt)["step"]
            except CheckpointError as exc:
                problems.append(str(exc))
            else:
                if m and int(m.group(1)) != step:
                    problems.append(f"{TRAINER_STATE_FILE} says step {step}, directory {ckpt.name}")
        return problems

    # ----------------------------------------------------------------- retention

    def prune(self, keep: int) -> builtins.list[Path]:
        """Delete all but the ``keep`` highest-step checkpoints, oldest first; never the one
        ``latest()`` resolves to (it is kept in addition, should it not be among them).

        Each victim is first renamed to a ``.tmp-*`` name, so a crash mid-delete never leaves
        a half-deleted ``global_step_N`` that looks like a checkpoint. Returns the deleted
        paths. Raises ``ValueError`` if ``keep < 1``.
        """
        if isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        steps = self._step_dirs()
        protected = {path for _, path in steps[-keep:]}
        latest = self.latest()
        if latest is not None:
            protected.add(latest)
        removed = []
        for _, path in steps:
            if path in protected:
                continue
            trash = self.root / f"{TMP_PREFIX}deleting-{path.name}-{secrets.token_hex(4)}"
            os.rename(path, trash)
            shutil.rmtree(trash, ignore_errors=True)
            removed.append(path)
            logger.info("pruned checkpoint %s", path)
        if removed:
            fsync_dir(self.root)
        return removed
