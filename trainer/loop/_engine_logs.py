"""The end of the engines' logs, quoted by an ``EngineUnusableError`` (the run directory's
``engines/engine-I.log``: the servers the trainer started)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from engines.launch import LOG_TAIL_CHARS
from trainer.errors import EngineUnusableError

__all__ = ["engine_logs_on_unusable", "engine_logs_tail"]


async def engine_logs_tail(run_dir: Path, chars: int = LOG_TAIL_CHARS) -> str:
    """The last ``chars`` characters of each engine log in ``run_dir/engines`` ("" if none)."""

    def read() -> str:
        tails = []
        for log in sorted((run_dir / "engines").glob("engine-*.log")):
            try:
                text = log.read_bytes()[-chars:].decode(errors="replace")
            except OSError:
                continue
            # a progress bar's carriage returns: what a terminal would show of each line
            text = "\n".join(line.rsplit("\r", 1)[-1] for line in text.split("\n"))
            tails.append(f"[{log.name}]\n{text}")
        return "\n".join(tails)

    return await trio.to_thread.run_sync(read)


@asynccontextmanager
async def engine_logs_on_unusable(run_dir: Path) -> AsyncIterator[None]:
    """An ``EngineUnusableError`` raised in the block comes out with the engines' log tails
    (where it has none), chained as the original was."""
    try:
        yield
    except EngineUnusableError as exc:
        if exc.log_tail:
            raise
        tail = ""
        with trio.CancelScope(shield=True):
            tail = await engine_logs_tail(run_dir)
        if not tail:
            raise
        raise EngineUnusableError(exc.urls, exc.reason, tail) from exc.__cause__
