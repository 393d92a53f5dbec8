"""The line a server prints once it listens, and how its launcher reads it: one definition for
the reference server (``engines.local``) and both launchers (processes, Ray actors)."""

from __future__ import annotations

import re

__all__ = ["READY_PREFIX", "READY_RE", "ready_line"]

#: First word of the line printed once the server listens.
READY_PREFIX = "ENGINE_READY"
#: Finds the line in a server's log (its port in group 1); earlier lines of the log may hold
#: a stale one, which the launchers skip by reading only what this start wrote.
READY_RE = re.compile(rf"^{READY_PREFIX} port=(\d+)", re.MULTILINE)


def ready_line(host: str, port: int) -> str:
    """``ENGINE_READY port=N url=http://HOST:N``."""
    return f"{READY_PREFIX} port={port} url=http://{host}:{port}"
