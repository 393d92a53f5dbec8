"""Where an engine may take weights from: files under the run's folder, groups at the run's address.

A weight update names where its weights come from: the ``disk`` backend a file
(``update_info.path``), the ``gloo``/``nccl`` backends an address to connect to
(``init_info.master_address``). Whoever can post to the weight routes chooses these, so an
engine checks them against what its run told it at start-up, before opening or connecting
to anything:

- **files**: only regular files under the weight folder (``TRAINER_WEIGHT_DIR``, or the
  reference server's ``--weight-dir``; the trainer names its run's ``weight_sync/`` folder),
  reached without following a symbolic link at any step below that folder
  (:func:`open_weight_file`). No folder given: disk updates are refused, saying how to allow
  them. A path outside the folder is refused with the same sentence whether or not it exists,
  so an answer says nothing about files elsewhere.
- **addresses**: ``master_address`` must be one of the run's weight-sync hosts
  (``TRAINER_WEIGHT_SYNC_HOSTS``, comma-separated, or ``--weight-sync-hosts``; unset: loopback
  only, :data:`LOOPBACK_HOSTS`), compared as written (IP addresses in canonical form; no name
  is looked up), before any connection is attempted (:func:`check_master_address`).

The reference server (:mod:`engines.local.weight_routes`) and the project's vLLM plugins
(:mod:`engines.vllm.disk_engine`, :mod:`engines.vllm.gloo_engine`) share these checks; this
module imports nothing heavier than the standard library at import time, as the plugins run
inside vLLM's own environment.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

__all__ = [
    "LOOPBACK_HOSTS",
    "SYNC_HOSTS_ENV",
    "WEIGHT_DIR_ENV",
    "WeightAccessError",
    "check_master_address",
    "load_weight_file",
    "open_weight_file",
    "parse_hosts",
    "require_weight_dir",
    "sync_hosts_from_env",
    "weight_dir_from_env",
]

#: Environment variable: the only folder whose files a ``disk`` weight update may read.
WEIGHT_DIR_ENV = "TRAINER_WEIGHT_DIR"
#: Environment variable: comma-separated addresses a weight-sync ``master_address`` may name.
SYNC_HOSTS_ENV = "TRAINER_WEIGHT_SYNC_HOSTS"
#: The weight-sync hosts when none are given: this machine only.
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})


class WeightAccessError(ValueError):
    """A weight source the engine refuses. ``forbidden``: the request named something outside
    what the run allows (an HTTP server answers 403); else the source is allowed but could not
    be used (missing, unreadable: the update failed)."""

    def __init__(self, message: str, *, forbidden: bool) -> None:
        super().__init__(message)
        self.message = message
        self.forbidden = forbidden


def weight_dir_from_env(env: Mapping[str, str] | None = None) -> str | None:
    """``TRAINER_WEIGHT_DIR`` from ``env`` (default ``os.environ``); None when unset or empty."""
    value = (os.environ if env is None else env).get(WEIGHT_DIR_ENV, "").strip()
    return value or None


def parse_hosts(text: str | None) -> frozenset[str]:
    """Comma-separated hosts as a set (blanks dropped); None or blank: :data:`LOOPBACK_HOSTS`."""
    hosts = frozenset(h.strip() for h in (text or "").split(",") if h.strip())
    return hosts or LOOPBACK_HOSTS


def sync_hosts_from_env(env: Mapping[str, str] | None = None) -> frozenset[str]:
    """The weight-sync hosts ``TRAINER_WEIGHT_SYNC_HOSTS`` names (unset: loopback only)."""
    return parse_hosts((os.environ if env is None else env).get(SYNC_HOSTS_ENV))


def _canonical(host: str) -> str:
    host = host.strip().lower().removeprefix("[").removesuffix("]")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return host


def check_master_address(address: object, allowed: Iterable[str], *, setting: str) -> str:
    """``address`` when it is one of ``allowed``; else :class:`WeightAccessError` (forbidden)
    naming ``setting`` (the flag or variable that lists the hosts). Nothing is resolved or
    connected to: call it before joining a group."""
    hosts = sorted(allowed)
    if not isinstance(address, str) or _canonical(address) not in {_canonical(h) for h in hosts}:
        raise WeightAccessError(
            f"init_info.master_address {address!r} is not one of this server's weight-sync "
            f"hosts ({', '.join(hosts)}): add it to {setting} to allow it",
            forbidden=True,
        )
    return address


def require_weight_dir(weight_dir: str | None, *, setting: str) -> str:
    """``weight_dir``; :class:`WeightAccessError` (forbidden) saying how to set it when None
    (disk weight updates are off)."""
    if weight_dir is None:
        raise WeightAccessError(
            f"disk weight updates are off: start the server with {setting} naming the folder "
            "the trainer writes its weight buckets to (the run's weight_sync/)",
            forbidden=True,
        )
    return weight_dir


def _outside(setting: str) -> WeightAccessError:
    return WeightAccessError(
        f"update_info.path must name a file under this server's weight folder ({setting})",
        forbidden=True,
    )


def _relative_parts(path: str, weight_dir: str) -> list[str]:
    """``path``'s parts below ``weight_dir`` (as written, or with its links resolved)."""
    if "\x00" in path or not path.startswith("/"):
        return []
    parts = PurePosixPath(path).parts
    if ".." in parts:
        return []
    for root in (os.path.abspath(weight_dir), os.path.realpath(weight_dir)):
        root_parts = PurePosixPath(root).parts
        if parts[: len(root_parts)] == root_parts and len(parts) > len(root_parts):
            return [p for p in parts[len(root_parts) :] if p != "."]
    return []


def open_weight_file(path: object, weight_dir: str | None, *, setting: str) -> int:
    """Open ``path`` for reading and return its file descriptor (the caller closes it), where
    it names a regular file under ``weight_dir`` reached without following a link below it.

    ``setting`` names the flag or variable that sets the folder, for the messages. Raises
    :class:`WeightAccessError`: forbidden (no folder given; an absolute path not under it, a
    ``..``, a relative path; a symbolic link or a non-regular file below it), or not (the file
    is missing or unreadable: its message names the path, which is inside the folder).
    """
    weight_dir = require_weight_dir(weight_dir, setting=setting)
    if not isinstance(path, str):
        raise WeightAccessError("update_info.path must be a string", forbidden=True)
    parts = _relative_parts(path, weight_dir)
    if not parts:
        raise _outside(setting)
    try:
        here = os.open(os.path.realpath(weight_dir), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise WeightAccessError(
            f"the weight folder {weight_dir} ({setting}) cannot be opened: {exc.strerror}",
            forbidden=False,
        ) from None
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            flags |= os.O_NONBLOCK if last else os.O_DIRECTORY  # a FIFO must not block the open
            try:
                fd = os.open(part, flags, dir_fd=here)
            except OSError as exc:
                raise _refusal(path, exc) from None
            os.close(here)
            here = fd
        if not stat.S_ISREG(os.fstat(here).st_mode):
            raise WeightAccessError(f"{path} is not a regular file", forbidden=True)
        os.set_blocking(here, True)
    except BaseException:
        os.close(here)
        raise
    return here


def _refusal(path: str, exc: OSError) -> WeightAccessError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return WeightAccessError(
            f"{path}: a symbolic link or a non-folder on the way: refused (weight files are "
            "opened without following links)",
            forbidden=True,
        )
    return WeightAccessError(f"cannot read {path}: {exc.strerror}", forbidden=False)


def load_weight_file(
    path: object, weight_dir: str | None, *, setting: str
) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file ``path``, opened by :func:`open_weight_file`;
    blocking. Raises :class:`WeightAccessError` as it does, and (not forbidden) for a file
    that is not safetensors."""
    from safetensors.torch import load, load_file  # in the engines' environments only

    fd = open_weight_file(path, weight_dir, setting=setting)
    try:
        by_fd = f"/proc/self/fd/{fd}"
        try:
            if os.path.exists(by_fd):  # memory-mapped, the very file opened above
                return load_file(by_fd)
            with os.fdopen(os.dup(fd), "rb") as f:
                return load(f.read())
        except Exception as exc:  # safetensors' own errors: a corrupt header, a short file
            raise WeightAccessError(f"cannot read {path}: {exc}", forbidden=False) from None
    finally:
        os.close(fd)
