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
  ``save_state``/``load_state``, ``rng_state``/``set_rng_state``.
- Driver side: ``CheckpointManager`` (its methods block too: the loop calls ``save`` through
  ``trio.to_thread.run_sync`` inside ``operation("save_checkpoint")``).

One writer per ``root``: a save removes every ``.tmp-*`` entry it finds, including one a
concurrent writer would be using. Directory fsync is POSIX-only.

Errors: ``CheckpointError(RuntimeError)`` for a checkpoint that is missing, incomplete,
corrupted, or holds something this module refuses to load; ``ValueError`` for bad arguments.
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import json
import logging
import os
import pickle
import random
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
    import torch

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
_CHUNK = 1 << 20


# --------------------------------------------------------------------------- file helpers


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path: Path, *, fsync: bool = False) -> tuple[str, int]:
    """sha256 and size of ``path``; with ``fsync``, also flush it to disk in the same pass."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        if fsync:
            os.fsync(f.fileno())
    return h.hexdigest(), size


def _files_under(directory: Path) -> builtins.list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        out.extend(Path(dirpath, name) for name in sorted(filenames))
    return out


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- worker side


def save_model(model: torch.nn.Module, directory: Path) -> None:
    """Write ``model``'s weights to ``directory`` as safetensors; blocking.

    A model with ``save_pretrained`` (a Hugging Face ``PreTrainedModel``) is saved with it, so
    the directory is loadable by ``from_pretrained`` (config.json included) and tied weights
    (``tie_word_embeddings``) are stored once. Any other module goes to
    ``directory/model.safetensors`` via ``safetensors.torch.save_model``, which also stores
    shared tensors once. ``directory`` is created if needed.

    Raises ``CheckpointError`` if ``save_pretrained`` wrote no ``*.safetensors`` file (a custom
    override writing pickles, which ``load_model`` would refuse).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_pretrained = getattr(model, "save_pretrained", None)
    if callable(save_pretrained):
        kwargs: dict[str, Any] = {}
        # transformers 4.x takes safe_serialization (default True since 4.35); 5.x always
        # writes safetensors and silently drops the keyword, so pass it only where it exists.
        if "safe_serialization" in inspect.signature(save_pretrained).parameters:
            kwargs["safe_serialization"] = True
        save_pretrained(directory, **kwargs)
        if not any(directory.glob("*.safetensors")):
            raise CheckpointError(
                f"{type(model).__name__}.save_pretrained wrote no *.safetensors file into "
                f"{directory}; checkpoints must be safetensors (pickled weights are never loaded)"
            )
        return
    from safetensors.torch import save_model as st_save_model

    st_save_model(model, str(directory / "model.safetensors"))


def _weight_files(directory: Path) -> builtins.list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index ({exc!r})") from None
        return [directory / name for name in sorted(set(weight_map.values()))]
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise CheckpointError(
            f"no safetensors weights in {directory} (expected model.safetensors or "
            "model.safetensors.index.json); was it written by save_model?"
        )
    return found


def load_model(model: torch.nn.Module, directory: Path) -> None:
    """Load safetensors weights from ``directory`` into ``model`` in place, strictly; blocking.

    Reads ``model.safetensors``, the shards named by ``model.safetensors.index.json``, or every
    ``*.safetensors`` file. A key the file lacks is fine when it names a tensor *tied* to one
    the file has (``lm_head.weight`` with ``tie_word_embeddings``): tied tensors are one
    parameter, loaded once. Tensors are copied into the existing parameters, so their
    device and dtype stay the model's.

    Raises ``CheckpointError`` naming the keys if any are missing, unexpected or of the wrong
    shape (the checkpoint belongs to a different architecture or config), and if no weights
    file exists.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    loaded: dict[str, torch.Tensor] = {}
    for path in _weight_files(directory):
        part = load_file(str(path), device="cpu")
        dup = loaded.keys() & part.keys()
        if dup:
            raise CheckpointError(f"{path} repeats tensors of another shard: {sorted(dup)[:5]}")
        loaded.update(part)

    expected = model.state_dict(keep_vars=True)
    groups: dict[int, builtins.list[str]] = {}
    for name, tensor in [
        *model.named_parameters(remove_duplicate=False),
        *model.named_buffers(remove_duplicate=False),
    ]:
        groups.setdefault(id(tensor), []).append(name)
    alias_of = {name: names for names in groups.values() for name in names}

    full: dict[str, torch.Tensor] = {}
    missing = []
    for key in expected:
        source = key if key in loaded else None
        if source is None:
            source = next((a for a in alias_of.get(key, ()) if a in loaded), None)
        if source is None:
            missing.append(key)
        else:
            full[key] = loaded[source]
    unexpected = sorted(loaded.keys() - expected.keys())
    wrong_shape = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in full.items()
        if tuple(v.shape) != tuple(expected[k].shape)
    ]
    if missing or unexpected or wrong_shape:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s) {missing[:8]}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} key(s) {unexpected[:8]}")
        if wrong_shape:
            parts.append(f"wrong shape: {wrong_shape[:8]}")
        raise CheckpointError(
            f"weights in {directory} do not match {type(model).__name__}: "
            + "; ".join(parts)
            + ". Load a checkpoint into a model built from the same architecture and config."
        )
    model.load_state_dict(full, strict=True)


def save_state(obj: Any, path: Path) -> None:
    """``torch.save`` a state dict (optimizer, scheduler, RNG) to ``path``; blocking.

    ``obj`` must hold only tensors, numbers, strings, ``None`` and lists/tuples/dicts of them
    (as ``state_dict()`` of torch optimizers and schedulers do): anything else saves fine but
    ``load_state`` will refuse it. The parent directory is created if needed. Not atomic on its
    own: inside ``CheckpointManager.save``'s ``write`` callback the manager makes it so.
    """
    import torch

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(obj, path)


def load_state(path: Path, *, map_location: str | torch.device = "cpu") -> Any:
    """Load what ``save_state`` wrote, with ``torch.load(weights_only=True)``; blocking.

    Tensors land on ``map_location`` (``cpu`` by default; ``optimizer.load_state_dict`` moves
    them to its parameters' device). Raises ``CheckpointError`` if the file holds a pickled
    object other than tensors and plain containers (never executed), and
    ``FileNotFoundError`` if it does not exist.
    """
    import torch

    try:
        return torch.load(Path(path), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(
            f"refusing to load {path}: it holds a pickled object that is not a tensor or a plain "
            f"container ({first}). Checkpoint state may only hold tensors, numbers, strings and "
            "lists/tuples/dicts of them; save a state_dict() with save_state instead."
        ) from exc


def rng_state() -> dict[str, Any]:
    """Snapshot of every global RNG: Python ``random``, torch CPU, CUDA (when available), numpy.

    Only tensors and plain values (numpy's state is converted to a tensor), so it round-trips
    through ``save_state``/``load_state`` with ``weights_only=True``.
    """
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {
        "kind": str(kind),
        "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
        "pos": int(pos),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned; each RNG present in ``state`` is restored.

    A CUDA state on a machine without CUDA is skipped with a warning (a GPU checkpoint resumed
    on a CPU stays deterministic on the CPU side); with fewer GPUs than saved, the first ones
    are restored and a warning is logged. Raises ``ValueError`` for an unknown key.
    """
    import torch

    unknown = set(state) - {"python", "torch", "cuda", "numpy"}
    if unknown:
        raise ValueError(
            f"unknown RNG state keys {sorted(unknown)}; expected python, torch, cuda, numpy"
        )
    if "python" in state:
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(state["torch"].to(device="cpu", dtype=torch.uint8))
    if "cuda" in state:
        saved = builtins.list(state["cuda"])
        if not torch.cuda.is_available():
            logger.warning("checkpoint holds CUDA RNG state but CUDA is not available; skipped")
        else:
            n = torch.cuda.device_count()
            if n != len(saved):
                logger.warning(
                    "checkpoint holds CUDA RNG state for %d device(s), this machine has %d; "
                    "restoring the first %d",
                    len(saved),
                    n,
                    min(n, len(saved)),
                )
            for i, s in enumerate(saved[:n]):
                torch.cuda.set_rng_state(s.cpu(), i)
    if "numpy" in state:
        import numpy as np

        s = state["numpy"]
        np.random.set_state(
            (
                s["kind"],
                s["keys"].numpy().astype(np.uint32),
                s["pos"],
                s["has_gauss"],
                s["cached_gaussian"],
            )
        )


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
            _write_text_synced(tmp / TRAINER_STATE_FILE, state_json + "\n")
            files = {}
            for path in _files_under(tmp):
                digest, size = _sha256(path, fsync=True)
                files[path.relative_to(tmp).as_posix()] = {"size": size, "sha256": digest}
            manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
            _write_text_synced(tmp / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")
            for dirpath, _dirs, _files in os.walk(tmp, topdown=False):
                _fsync_dir(Path(dirpath))
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
        _fsync_dir(self.root)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def _write_latest(self, name: str) -> None:
        tmp = self.root / f"{TMP_PREFIX}{LATEST_FILE}-{secrets.token_hex(4)}"
        try:
            _write_text_synced(tmp, name + "\n")
            os.replace(tmp, self.root / LATEST_FILE)
        except BaseException:
            _remove(tmp)
            raise
        _fsync_dir(self.root)

    def _remove_stale_tmp(self) -> None:
        for entry in sorted(self.root.glob(f"{TMP_PREFIX}*")):
            logger.warning("removing %s, left behind by an interrupted checkpoint write", entry)
            _remove(entry)

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
            files = _files_under(path)
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
            if _sha256(file)[0] != want_sha:
                problems.append(f"{rel}: sha256 differs from the manifest (corrupted or modified)")
        for file in _files_under(ckpt):
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
            _fsync_dir(self.root)
        return removed
