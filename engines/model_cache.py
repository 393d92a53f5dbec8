"""Model directories built once into the cache, atomically and one builder at a time.

Shared by the built-in tiny model (:func:`engines.models.build_tiny_model`) and the GGUF
conversion (:mod:`engines.gguf_models`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["LOCK_TIMEOUT_S", "build_directory_atomically"]

#: How long a builder waits for another process's build of the same directory (converting
#: SmolLM2 takes about 30 s here).
LOCK_TIMEOUT_S = 900.0


def build_directory_atomically(target: Path, build: Callable[[Path], None]) -> Path:
    """``target``, made by ``build(tmp)`` into a temporary directory beside it, then renamed:
    a half-built directory is never at ``target`` (a crash leaves no target; its temporary
    directory is removed when the exception passes here). One builder at a time per target,
    across processes (a lock file beside it): a second run, or a second test worker, waits
    and then reuses what the first built. Blocking."""
    from filelock import FileLock, Timeout

    target.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(target.parent / f".{target.name}.lock"), timeout=LOCK_TIMEOUT_S)
    # a bounded wait (DESIGN 3): a live builder stuck on the same directory is an error
    try:
        lock.acquire()
    except Timeout:
        raise TimeoutError(
            f"another process has been building {target} for over {LOCK_TIMEOUT_S:g}s (it "
            f"holds {lock.lock_file}): wait for it, or stop it; a builder that died releases "
            "the lock by itself"
        ) from None
    try:
        if (target / "config.json").is_file():
            return target  # built by the process that held the lock before us
        tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            build(tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    return target
