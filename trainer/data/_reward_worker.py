"""One reward worker process: ``python -m trainer.data._reward_worker SPEC``.

It imports the reward function ``SPEC`` names (``module:function`` or a built-in name), says
``("ready",)`` (or ``("fatal", why)``), then answers each request ``(response, answer,
extra)`` with ``("ok", reward)`` or ``("error", "Type: message")`` until its stdin closes.
Messages (:mod:`trainer.data._reward_wire`) come on stdin and go to the stdout the process
started with; what the reward function prints goes to stderr instead. The reward runs
in this process's main thread, so ``signal.alarm`` timeouts (math-verify's) work in it.
"""

from __future__ import annotations

import os
import pickle
import sys
from typing import Any, BinaryIO

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


def main(spec: str) -> int:
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward function's prints must not garble the replies
    try:
        from trainer.data._examples import resolve_reward_fn

        fn = resolve_reward_fn(spec, default=float)
    except BaseException as exc:  # reported to the trainer, which raises it with the spec
        _write(out, ("fatal", f"{type(exc).__name__}: {exc}"))
        return 1
    _write(out, ("ready",))
    while (request := _read(sys.stdin.buffer)) is not None:
        response, answer, extra = request
        try:
            reply: tuple[str, Any] = ("ok", float(fn(response, answer, extra)))
        except Exception as exc:
            reply = ("error", f"{type(exc).__name__}: {exc}")
        _write(out, reply)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
