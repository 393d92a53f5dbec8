"""When a started server is ready, for both launchers: its ready line, then ``GET /health``.

The reference server prints :func:`ready_line` once it listens (``--port 0``: it picked its
port); a server told its port up front (``vllm serve``) prints none. :func:`wait_all_ready`
is the one start-up wait, whatever started the servers (a trio process here, a Ray actor on
another node): for each server, concurrently, the port (from the ready line when it picked
one), then ``/health`` answering 200 from this process; a server that exits first raises
:class:`~trainer.errors.EngineStartError` with its log tail, and so does one not healthy
within the bound (the first such, with the reason the launcher gives).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import httpx
import trio

from engines.launch._spec import base_url
from trainer.errors import EngineStartError
from trainer.vocabulary import exception_leaves, raise_first

__all__ = [
    "READY_PREFIX",
    "READY_RE",
    "StartingServer",
    "exit_text",
    "ready_line",
    "ready_port",
    "wait_all_ready",
]

#: First word of the line printed once the server listens.
READY_PREFIX = "ENGINE_READY"
#: Finds the line in a server's log (its port in group 1); earlier lines of the log may hold
#: a stale one, which the launchers skip by reading only what this start wrote.
READY_RE = re.compile(rf"^{READY_PREFIX} port=(\d+)", re.MULTILINE)
#: Characters of a starting server's log searched for its ready line.
READY_SEARCH_CHARS = 1 << 20


def ready_line(host: str, port: int) -> str:
    """``ENGINE_READY port=N url=http://HOST:N``."""
    return f"{READY_PREFIX} port={port} url=http://{host}:{port}"


def ready_port(log: str) -> int | None:
    """The port of the ready line in ``log`` (what this start wrote); None before it."""
    match = READY_RE.search(log)
    return None if match is None else int(match.group(1))


def exit_text(returncode: int | None) -> str | None:
    """How a process ended ("exit code N", "signal N"), from its return code; None: running."""
    if returncode is None:
        return None
    return f"signal {-returncode}" if returncode < 0 else f"exit code {returncode}"


class StartingServer(Protocol):
    """A started server as its launcher sees it while waiting for it."""

    #: ``http://HOST:PORT`` once its port is known; a placeholder naming it before that.
    url: str
    #: True once it answered ``/health``.
    ready: bool

    @property
    def host(self) -> str:
        """Where this process reaches it."""
        ...

    async def port(self) -> int | None:
        """The port it listens on (told, or from its ready line); None: not listening yet."""
        ...

    async def exit_status(self) -> str | None:
        """How it ended ("exit code N", "signal N"); None while it runs."""
        ...

    async def log_tail(self) -> str:
        """What this start of it wrote to its log, the last characters ("" if unreadable)."""
        ...


async def _wait_ready(
    server: StartingServer, api_key: str | None, http: httpx.AsyncClient, poll_s: float
) -> None:
    """Wait for the port, then for ``/health`` 200; raise if the server exits first."""

    async def died(how: str) -> EngineStartError:
        return EngineStartError(
            server.url, f"exited during start-up ({how})", await server.log_tail()
        )

    while (port := await server.port()) is None:
        if (how := await server.exit_status()) is not None:
            raise await died(how)
        await trio.sleep(poll_s)
    server.url = base_url(server.host, port)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while True:
        if (how := await server.exit_status()) is not None:
            raise await died(how)
        try:
            response = await http.get(f"{server.url}/health", headers=headers)
            if response.status_code == 200:
                server.ready = True
                return
        except httpx.TransportError:
            pass
        await trio.sleep(poll_s)


S = TypeVar("S", bound=StartingServer)


async def wait_all_ready(
    servers: Sequence[S],
    api_key: str | None,
    timeout_s: float,
    not_ready: Callable[[S], str],
    *,
    poll_s: float,
) -> None:
    """Wait until every server is healthy, concurrently, within ``timeout_s``.

    ``EngineStartError`` with the log tail of the first server that exits during start-up
    (several: the first, the others as notes), or of the first not ready in time, its reason
    ``not_ready(server)``.
    """
    async with httpx.AsyncClient(timeout=5.0) as http:
        with trio.move_on_after(timeout_s) as scope:
            try:
                async with trio.open_nursery() as nursery:
                    for server in servers:
                        nursery.start_soon(_wait_ready, server, api_key, http, poll_s)
            except BaseExceptionGroup as group:
                _, errors = group.split(trio.Cancelled)
                if errors is None:
                    raise
                raise_first(exception_leaves(errors))
    if scope.cancelled_caught:
        slow = next((s for s in servers if not s.ready), servers[0])
        raise EngineStartError(slow.url, not_ready(slow), await slow.log_tail())
