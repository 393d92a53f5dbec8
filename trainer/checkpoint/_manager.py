"""Atomic checkpoints: save, resume, retention (DESIGN 4.6 and 5).

The layout under ``RUN_DIR/checkpoints``, the manifest and the trainer state are described,
read and checked in ``trainer.checkpoint._layout`` (its file-name constants are re-exported
here). Listing a run's checkpoints for a person is ``trainer.checkpoint._inspect``.

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
  ``save_state``/``load_state``, ``rng_state``/``set_rng_state`` (in ``trainer.checkpoint._io``,
  re-exported here).
- Driver side: ``CheckpointManager`` (its methods block too: the loop calls ``save`` through
  ``trio.to_thread.run_sync`` inside ``operation("save_checkpoint")``).

One writer per ``root``: a save removes every ``.tmp-*`` entry it finds, including one a
concurrent writer would be using. Directory fsync is POSIX-only.

Errors: ``CheckpointError(RuntimeError)`` for a checkpoint that is missing, incomplete,
corrupted, or holds something this module refuses to load; ``ValueError`` for bad arguments.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import attrs

from trainer.checkpoint._io import (
    PRIVATE_DIR_MODE,
    fsync_dir,
    load_model,
    load_state,
    make_private,
    remove_path,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
    write_text_synced,
)
from trainer.checkpoint._layout import (
    LATEST_FILE,
    MANIFEST_FILE,
    STEP_DIR_PREFIX,
    TMP_PREFIX,
    TRAINER_STATE_FILE,
    is_complete,
    parse_step_dir_name,
    read_trainer_state,
    step_dirs,
    verify,
    write_manifest,
)
from trainer.errors import CheckpointError

__all__ = [
    "LATEST_FILE",
    "MANIFEST_FILE",
    "RESUME_MODES",
    "STEP_DIR_PREFIX",
    "TMP_PREFIX",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "CheckpointManager",
    "load_model",
    "load_state",
    "rng_state",
    "save_model",
    "save_state",
    "set_rng_state",
]

logger = logging.getLogger("trainer.checkpoint")

#: The allowed values of ``trainer.resume_mode``.
RESUME_MODES: tuple[str, ...] = ("none", "latest", "path")


#: The checkpoint's subdirectory that holds the trained policy (the workers write it).
POLICY_DIR = "policy"
#: A model directory's files that make up its tokenizer and chat template (``fnmatch``
#: patterns), copied beside a checkpoint's policy weights.
TOKENIZER_FILES = (
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.*",
    "merges.txt",
    "chat_template.*",
    "*.model",
)


def copy_tokenizer_files(model_dir: Path, dest: Path) -> list[str]:
    """Copy ``model_dir``'s tokenizer files (:data:`TOKENIZER_FILES`) into ``dest``; their names.
    A name the writer already put there is left as it is."""
    copied = []
    for source in sorted(Path(model_dir).iterdir()):
        target = dest / source.name
        wanted = any(fnmatch.fnmatch(source.name, p) for p in TOKENIZER_FILES)
        if not wanted or not source.is_file() or target.exists():
            continue
        shutil.copyfile(source, target)
        fd = os.open(target, os.O_RDONLY)
        try:
            os.fsync(fd)  # durable before the manifest and the rename, as the rest
        finally:
            os.close(fd)
        copied.append(source.name)
    return copied


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
    tokenizer_from: Path | None = attrs.field(default=None)
    """The model directory whose tokenizer files (its chat template included) each save copies
    into the checkpoint's ``policy/``, so that it is a model directory transformers and
    ``vllm serve`` take as it is (:data:`TOKENIZER_FILES`); None: the weights alone."""

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
        ``max_to_keep``. Returns the checkpoint directory. Its folders are mode 0700 and its
        files 0600 (``latest`` too): a checkpoint is the user's alone.

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
        self.root.mkdir(mode=PRIVATE_DIR_MODE, parents=True, exist_ok=True)
        self._remove_stale_tmp()
        final = self.step_dir(step)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{final.name}-", dir=self.root))
        try:
            write(tmp)
            if self.tokenizer_from is not None and (tmp / POLICY_DIR).is_dir():
                copy_tokenizer_files(self.tokenizer_from, tmp / POLICY_DIR)
            for owned in (TRAINER_STATE_FILE, MANIFEST_FILE):
                if (tmp / owned).exists():
                    raise CheckpointError(
                        f"the checkpoint writer created {owned}, which CheckpointManager owns; "
                        "pass trainer state in the trainer_state dict instead"
                    )
            write_text_synced(tmp / TRAINER_STATE_FILE, state_json + "\n")
            total = write_manifest(tmp, step)
            make_private(tmp)  # whoever wrote the files, and with whatever umask
            for dirpath, _dirs, _files in os.walk(tmp, topdown=False):
                fsync_dir(Path(dirpath))
            self._install(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._write_latest(final.name)
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
            remove_path(old)  # a link is removed as a link, never followed

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

    #: ``trainer.checkpoint._layout.read_trainer_state``, here for whoever holds the manager.
    read_trainer_state = staticmethod(read_trainer_state)
    #: ``trainer.checkpoint._layout.verify``, here for whoever holds the manager.
    verify = staticmethod(verify)

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
        complete = [p for _, p in step_dirs(self.root) if is_complete(p)]
        if text is not None:
            if parse_step_dir_name(text) is not None and is_complete(self.root / text):
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
            if not is_complete(found):
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

    # ----------------------------------------------------------------- retention

    def prune(self, keep: int) -> list[Path]:
        """Delete all but the ``keep`` highest-step checkpoints, oldest first; never the one
        ``latest()`` resolves to (it is kept in addition, should it not be among them).

        Each victim is first renamed to a ``.tmp-*`` name, so a crash mid-delete never leaves
        a half-deleted ``global_step_N`` that looks like a checkpoint. A step folder that is a
        symbolic link is never followed: the link alone is removed (what it points at is not
        the run's to delete), and nothing is left behind. Returns the deleted paths. Raises
        ``ValueError`` if ``keep < 1``.
        """
        if isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep!r}")
        steps = step_dirs(self.root)
        protected = {path for _, path in steps[-keep:]}
        latest = self.latest()
        if latest is not None:
            protected.add(latest)
        removed = []
        for _, path in steps:
            if path in protected:
                continue
            if path.is_symlink():
                target = os.readlink(path)
                path.unlink()
                logger.info("pruned checkpoint %s, a link (%s is left as it is)", path, target)
            else:
                trash = self.root / f"{TMP_PREFIX}deleting-{path.name}-{secrets.token_hex(4)}"
                os.rename(path, trash)
                shutil.rmtree(trash, ignore_errors=True)
                logger.info("pruned checkpoint %s", path)
            removed.append(path)
        if removed:
            fsync_dir(self.root)
        return removed
