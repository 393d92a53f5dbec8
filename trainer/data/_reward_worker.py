"""One reward worker process: ``python -m trainer.data._reward_worker SPEC``.

It imports the reward function ``SPEC`` names (``module:function`` or a built-in name), says
``("ready",)`` (or ``("fatal", why)``), then answers each request ``(response, answer,
extra)`` with ``("ok", reward)`` or ``("error", "Type: message")`` until its stdin closes.
Messages (:mod:`trainer.data._reward_wire`) come on stdin and go to the stdout the process
started with; what the reward function prints goes to stderr instead. The reward runs
in this process's main thread, so ``signal.alarm`` timeouts (math-verify's) work in it.

``python -m trainer.data._reward_worker SPEC MAX_MEMORY_MB``: before anything else the worker
limits its data segment (``RLIMIT_DATA``: heap and private writable mappings, which a
reward's allocations are; not the address space, which thread stacks and arenas reserve
without using) to ``MAX_MEMORY_MB`` (0: no limit of its own), so that an allocation past it
raises ``MemoryError`` in the reward (an error the trainer counts) instead of taking the
host's memory; then it forks its reaper (:mod:`trainer.data._reward_reaper`), which kills
whatever the worker started once the worker ends, however it ends.
"""

from __future__ import annotations

import os
import pickle
import resource
import sys
from typing import Any, BinaryIO

from trainer.data._reward_reaper import WORKER_TOKEN_ENV, start_reaper
from trainer.data._reward_wire import HEADER, frame


def _write(out: BinaryIO, message: object) -> None:
    out.write(frame(message))
    out.flush()


def _read(inp: BinaryIO) -> Any | None:
    header = inp.read(HEADER.size)
    if len(header) < HEADER.size:
        return None
    (n,) = HEADER.unpack(header)
    return pickle.loads(inp.read(n))


def limit_memory(max_memory_mb: int) -> None:
    """At most ``max_memory_mb`` MiB of data segment for this process and what it starts
    (0: leave the limit as inherited)."""
    if max_memory_mb > 0:
        limit = max_memory_mb << 20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(spec: str, max_memory_mb: int = 0) -> int:
    limit_memory(max_memory_mb)
    start_reaper(os.environ.get(WORKER_TOKEN_ENV, ""))
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward function's prints must not garble the replies
    try:
        from trainer.data._examples import resolve_reward_fn

        fn = resolve_reward_fn(spec, default=float)
    except BaseException as exc:  # reported to the trainer, which raises it with the spec
        why = (
            f"past data.reward_max_memory_mb={max_memory_mb}"
            if isinstance(exc, MemoryError)
            else exc
        )
        _write(out, ("fatal", f"{type(exc).__name__}: {why}"))
        return 1
    _write(out, ("ready",))
    while (request := _read(sys.stdin.buffer)) is not None:
        response, answer, extra = request
        try:
            reply: tuple[str, Any] = ("ok", float(fn(response, answer, extra)))
        except MemoryError as exc:
            why = f"past data.reward_max_memory_mb={max_memory_mb}" if max_memory_mb else exc
            reply = ("error", f"MemoryError: {why}")
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _write(out, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 0))
