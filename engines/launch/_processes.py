"""The servers the trainer starts as its own child processes (``engine.placement=process``).

::

    async with launch_local_engines(2, model_dir, run_dir / "engines", seed=0) as urls:
        client = InferenceClient(urls)
        ...
    async with open_engine_processes(2, VllmServers(model_dir, ...), run_dir / "engines") as engines:
        ...

Each server (a :class:`~engines.launch.ServerSpec`) runs in its own process group (its own
session), stdout and stderr appended to ``LOG_DIR/engine-I.log``; start-up is the launchers'
one wait (:func:`~engines.launch._ready.wait_all_ready`), bounded by ``startup_timeout_s``;
every server already started is stopped when one fails.

Servers never outlive the trainer:

- on leaving the block (normally, on error or on cancellation) each server's stdin is
  closed and its process group gets SIGTERM, then SIGKILL after ``shutdown_timeout_s``;
  this cleanup is shielded from the cancellation and bounded;
- if the trainer dies without cleaning up (SIGKILL, a crash), each server started here gets
  SIGKILL from the kernel at that moment, whatever it is doing (its imports included): it runs
  under :mod:`engines.launch.parent_death`, started by :func:`~engines.launch.open_child`;
  a server forked by a fork server is killed by the fork server when the trainer's connection
  closes (:mod:`engines.launch.fork_server`);
- and the write end of each server's stdin pipe closes with the trainer: the server shuts
  itself down on end-of-file (a server without that option runs under
  :mod:`engines.launch.stdin_guard`, which does it for it).
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from engines.launch._children import ChildProcess, open_child
from engines.launch._fork_client import ForkedProcess, fork_process, forkable
from engines.launch._ready import READY_SEARCH_CHARS, exit_text, ready_port, wait_all_ready
from engines.launch._spec import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    LOG_TAIL_CHARS,
    ReferenceServers,
    ServerSpec,
    ServersSpec,
    base_url,
    new_api_key,
    popen_kwargs,
    server_env,
)
from engines.launch._stop import signal_group, stop_group

__all__ = [
    "EngineProcess",
    "EngineProcesses",
    "EngineUrls",
    "launch_local_engines",
    "open_engine_processes",
]

_POLL_S = 0.05


@attrs.define(eq=False)
class EngineProcess:
    """One server process the trainer started."""

    #: Position in the group (``engine-I.log``).
    index: int
    #: The process (its own process group: ``pgid == pid``): a child of this one, or of the
    #: fork server that started it.
    process: ChildProcess | ForkedProcess
    #: Where its stdout and stderr go.
    log_path: Path
    #: The address it listens on.
    host: str
    #: ``http://HOST:PORT`` once its port is known; a placeholder naming the process before that.
    url: str
    #: True once it answered ``/health``.
    ready: bool = False
    #: Size of the (appended) log when this process started: only what follows is its own.
    log_offset: int = 0
    #: The port it was told to use; None: read from its ``ENGINE_READY`` line.
    told_port: int | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    async def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The last ``chars`` characters this process wrote to its log ("" if unreadable).

        The log is appended across runs (a resumed run reuses its run directory), so
        earlier runs' lines, such as a stale ready line with an old port, are skipped.
        """
        try:
            data = await trio.Path(self.log_path).read_bytes()
        except OSError:
            return ""
        return data[self.log_offset :].decode(errors="replace")[-chars:]

    async def port(self) -> int | None:
        if self.told_port is not None:
            return self.told_port
        return ready_port(await self.log_tail(READY_SEARCH_CHARS))

    async def exit_status(self) -> str | None:
        return exit_text(self.process.poll())


async def _spawn(
    index: int,
    spec: ServerSpec,
    host: str,
    log_path: Path,
    env: dict[str, str],
    fork_server: str | None = None,
) -> EngineProcess:
    log_file = await trio.to_thread.run_sync(lambda: open(log_path, "ab"))  # noqa: SIM115
    offset = log_file.seek(0, 2)
    process: ChildProcess | ForkedProcess
    try:
        if fork_server is not None and forkable(spec.argv):
            process = await fork_process(
                fork_server,
                spec.argv,
                env={**env, **spec.env},
                cwd=os.getcwd(),
                stdout=log_file.fileno(),
                stderr=log_file.fileno(),
            )
        else:
            process = await open_child(spec.argv, **popen_kwargs(spec, log_file, env))
    finally:
        log_file.close()  # the child holds its own descriptor
    url = f"engine-{index} (pid {process.pid})" if spec.port is None else base_url(host, spec.port)
    return EngineProcess(
        index, process, log_path, host, url, log_offset=offset, told_port=spec.port
    )


async def _stop(engine: EngineProcess, timeout_s: float) -> None:
    """Close stdin, SIGTERM the process group, SIGKILL it after ``timeout_s``; reap it."""
    proc = engine.process
    if proc.stdin is not None:
        try:
            await proc.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass

    async def exited(wait_s: float) -> bool:
        with trio.move_on_after(wait_s):
            await proc.wait()
        return proc.returncode is not None

    await stop_group(proc.pid, timeout_s, exited)


class EngineProcesses(list[EngineProcess]):
    """The servers of :func:`open_engine_processes`, by index, and how to start one again.

    Whatever process sits at index ``I`` when the block exits is the one stopped, so a
    restarted server never outlives the trainer either.
    """

    def __init__(
        self,
        servers: ServersSpec,
        log_dir: Path,
        host: str,
        env: dict[str, str],
        api_key: str,
        startup_timeout_s: float,
        shutdown_timeout_s: float,
        fork_server: str | None = None,
    ) -> None:
        super().__init__()
        self.servers = servers
        self.log_dir = log_dir
        self.host = host
        self.env = env
        #: The servers' secret (``Authorization: Bearer``): the caller's, or a fresh one.
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s
        self.fork_server = fork_server

    async def spawn(self, index: int) -> EngineProcess:
        """Start server ``index`` (not waited for), appending to ``engine-I.log``."""
        spec = self.servers(index, self.host)
        log_path = self.log_dir / f"engine-{index}.log"
        return await _spawn(index, spec, self.host, log_path, self.env, self.fork_server)

    async def wait_ready(self, engines: Sequence[EngineProcess], reason: str) -> None:
        """Wait until ``engines`` are healthy within ``startup_timeout_s``; ``EngineStartError``
        (``reason`` when one is not in time)."""
        await wait_all_ready(
            engines, self.api_key, self.startup_timeout_s, lambda _: reason, poll_s=_POLL_S
        )

    def signal(self, index: int, sig: signal.Signals) -> None:
        """Send ``sig`` to server ``index``'s whole process group (gone already: nothing)."""
        signal_group(self[index].pid, sig)

    async def restart(self, index: int) -> EngineProcess:
        """Kill server ``index`` (its whole process group at once: it failed, so it gets no
        grace; shielded and bounded, a stopped one too), start it again and wait until it
        is healthy, within ``startup_timeout_s``: the new process (its URL may differ).
        ``EngineStartError`` with its log tail when it exits first or is not healthy in time."""
        with trio.CancelScope(shield=True):
            await _stop(self[index], 0.0)
        self[index] = engine = await self.spawn(index)
        timeout = f"not healthy within {self.startup_timeout_s:g}s of its restart"
        await self.wait_ready([engine], timeout)
        return engine


@asynccontextmanager
async def open_engine_processes(
    num_engines: int,
    servers: ServersSpec,
    log_dir: str | Path,
    *,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
    fork_server: str | None = None,
    weight_dir: str | Path | None = None,
    weight_sync_hosts: Sequence[str] = (),
) -> AsyncIterator[EngineProcesses]:
    """Start ``num_engines`` servers, wait until all are healthy, yield them; always stop them.

    Server ``I`` is ``servers(I, host)`` (a :class:`ServerSpec`), logs to
    ``log_dir/engine-I.log`` (appended), and gets ``env`` (default: this process's), the
    project on ``PYTHONPATH``, ``VLLM_API_KEY`` (``api_key``, or a fresh secret when it is
    None: ``engines.api_key`` says which, for the servers' clients), ``TRAINER_WEIGHT_DIR``
    (``weight_dir``, when given), ``TRAINER_WEIGHT_SYNC_HOSTS`` (``weight_sync_hosts``, when
    given; see :func:`~engines.launch.server_env`) and its spec's own variables. Raises
    ``EngineStartError`` (with the log tail) when a server exits during start-up or is not
    healthy within ``startup_timeout_s``; several failures raise the first, the others as
    notes. ``ValueError`` for ``num_engines < 1``. With ``fork_server``
    (the socket of :mod:`engines.launch.fork_server`), a server that is this Python running a
    module is forked from it instead of started afresh (no import cost; the same contract). Stopping is shielded
    and bounded by about ``shutdown_timeout_s + 5`` seconds whatever the cancellation state.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be at least 1, got {num_engines}")
    log_dir = Path(log_dir)
    await trio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    api_key = new_api_key() if api_key is None else api_key
    child_env = server_env(env, api_key, weight_dir=weight_dir, weight_sync_hosts=weight_sync_hosts)
    engines = EngineProcesses(
        servers,
        log_dir,
        host,
        child_env,
        api_key,
        startup_timeout_s,
        shutdown_timeout_s,
        fork_server,
    )
    try:
        for i in range(num_engines):
            engines.append(await engines.spawn(i))
        await engines.wait_ready(engines, f"not healthy within {startup_timeout_s:g}s")
        yield engines
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for engine in engines:
                    nursery.start_soon(_stop, engine, shutdown_timeout_s)


class EngineUrls(list[str]):
    """The servers' base URLs (``http://HOST:PORT``), by index, and the secret they ask for."""

    def __init__(self, urls: Sequence[str], api_key: str) -> None:
        super().__init__(urls)
        #: ``Authorization: Bearer`` of every route but the health probes.
        self.api_key = api_key


@asynccontextmanager
async def launch_local_engines(
    num_engines: int,
    model_dir: str | Path | None,
    log_dir: str | Path,
    *,
    seed: int = 0,
    host: str = "127.0.0.1",
    api_key: str | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    devices: Sequence[str] = (),
    fork_server: str | None = None,
    weight_dir: str | Path | None = None,
    weight_sync_hosts: Sequence[str] = (),
) -> AsyncIterator[EngineUrls]:
    """:func:`open_engine_processes` of :class:`ReferenceServers`, yielding the servers' base
    URLs (``http://HOST:PORT``) and their secret (``api_key``, or a fresh one: give it to the
    client, ``InferenceClient(urls, api_key=urls.api_key)``), forked from ``fork_server``
    where one is given. A server on
    ``cuda:N`` sees that GPU alone
    (``CUDA_VISIBLE_DEVICES``, as vLLM's servers are started), so everything it puts on CUDA,
    weight-transfer groups and buffers included, lands on that GPU."""
    if not math.isfinite(startup_timeout_s) or startup_timeout_s <= 0:
        raise ValueError(f"startup_timeout_s must be a positive number, got {startup_timeout_s}")
    model = None if model_dir is None else str(model_dir)
    servers = ReferenceServers(model, seed, tuple(extra_args), tuple(devices))
    async with open_engine_processes(
        num_engines,
        servers,
        log_dir,
        host=host,
        api_key=api_key,
        startup_timeout_s=startup_timeout_s,
        shutdown_timeout_s=shutdown_timeout_s,
        fork_server=fork_server,
        weight_dir=weight_dir,
        weight_sync_hosts=weight_sync_hosts,
    ) as engines:
        yield EngineUrls([e.url for e in engines], engines.api_key)
