"""Checkpoint files: synced writes, and what workers save and load (blocking calls).

The worker side of :mod:`trainer.checkpoint._manager`: ``save_model``/``load_model`` (safetensors, a
Hugging Face-loadable model directory), ``save_state``/``load_state`` (``torch.save`` /
``torch.load(weights_only=True)``: never arbitrary unpickling), ``rng_state``/``set_rng_state``,
and the fsync/sha256 helpers the manager uses. Every function blocks: call them from a worker
thread or process, never from the trio thread.
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
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from trainer.errors import CheckpointError

__all__ = [
    "files_under",
    "fsync_dir",
    "load_model",
    "load_state",
    "make_private",
    "remove_folder_atomically",
    "remove_path",
    "rng_state",
    "save_model",
    "save_state",
    "set_rng_state",
    "sha256_file",
    "write_folder_atomically",
    "write_text_synced",
]

_CHUNK = 1 << 20
logger = logging.getLogger("trainer.checkpoint")

# --------------------------------------------------------------------------- file helpers


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: The modes of what a checkpoint holds: the user's alone (``ckpt export`` writes a copy with
#: the umask's modes, to be served by another user).
PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def make_private(tree: Path) -> None:
    """Every folder under ``tree`` (itself included) mode 0700, every file 0600; a link is
    never followed (its own mode is left as it is). Blocking."""
    for dirpath, _dirs, files in os.walk(tree):
        os.chmod(dirpath, PRIVATE_DIR_MODE)
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                os.chmod(path, PRIVATE_FILE_MODE)


def _private_opener(path: str, flags: int) -> int:
    return os.open(path, flags, PRIVATE_FILE_MODE)


def write_text_synced(path: Path, text: str) -> None:
    """``text`` in ``path`` (made with mode 0600), flushed to disk."""
    with open(path, "w", encoding="utf-8", opener=_private_opener) as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def sha256_file(path: Path, *, fsync: bool = False) -> tuple[str, int]:
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


def files_under(directory: Path) -> builtins.list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames.sort()
        out.extend(Path(dirpath, name) for name in sorted(filenames))
    return out


def remove_path(path: Path) -> None:
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


def save_state(obj: object, path: Path) -> None:
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


# --------------------------------------------------------------------------- whole folders


def write_folder_atomically(
    final: Path,
    write: Callable[[Path], None],
    *,
    overwrite: bool = False,
    tmp_prefix: str = ".tmp-",
) -> None:
    """``write(folder)`` into a new folder that then appears at ``final`` complete or not at
    all; blocking.

    The folder is made beside ``final`` (named ``tmp_prefix...``), every file and folder in it
    is fsynced and made private, then it is renamed to ``final`` and the parent fsynced. An
    existing ``final`` is ``FileExistsError`` unless ``overwrite``, which moves it aside
    before the rename and removes it after. A failed ``write`` leaves nothing behind.
    """
    if final.exists() and not overwrite:
        raise FileExistsError(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix}{final.name}-", dir=final.parent))
    old: Path | None = None
    try:
        write(tmp)
        for file in files_under(tmp):
            sha256_file(file, fsync=True)
        make_private(tmp)
        for dirpath, _dirs, _files in os.walk(tmp, topdown=False):
            fsync_dir(Path(dirpath))
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix}old-", dir=final.parent))
            os.replace(final, old / final.name)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def remove_folder_atomically(folder: Path, *, tmp_prefix: str = ".tmp-") -> None:
    """Take ``folder`` away at once (a rename aside), then delete it; blocking."""
    aside = Path(tempfile.mkdtemp(prefix=f"{tmp_prefix}del-", dir=folder.parent))
    os.replace(folder, aside / folder.name)
    fsync_dir(folder.parent)
    shutil.rmtree(aside, ignore_errors=True)
