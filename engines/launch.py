"""Start and stop the engine servers the trainer owns: the one launcher, whatever the server.

::

    async with launch_local_engines(2, model_dir, run_dir / "engines", seed=0) as urls:
        client = InferenceClient(urls)
        ...
    async with open_engine_processes(2, VllmServers(model_dir, ...), run_dir / "engines") as engines:
        ...

What a server is comes from a :class:`ServerSpec` (command line, environment, port), made per
server by a callable: :class:`ReferenceServers` (``python -m engines.local serve --port 0
--exit-on-stdin-eof``) or :class:`engines.vllm_serve.VllmServers` (``vllm serve``). Each runs
in its own process group (its own session), stdout and stderr appended to
``LOG_DIR/engine-I.log``. Start-up waits for the server's ``ENGINE_READY`` line (a server
given ``--port 0``) or knows its port up front, then waits for ``GET /health``, bounded by
``startup_timeout_s``; a server that exits first, or is not healthy in time, raises
:class:`~trainer.errors.EngineStartError` carrying the tail of its log (and every server
already started is stopped).

Servers never outlive the trainer:

- on leaving the block (normally, on error or on cancellation) each server's stdin is
  closed and its process group gets SIGTERM, then SIGKILL after ``shutdown_timeout_s``;
  this cleanup is shielded from the cancellation and bounded;
- if the trainer dies without cleaning up (even SIGKILL), the write end of each server's
  stdin pipe closes with it, and the server shuts itself down on end-of-file (a server
  without that option runs under :mod:`engines.stdin_guard`, which does it for it).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Protocol

import attrs
import httpx
import trio

from engines.process_stop import signal_group, stop_group
from engines.ready_line import READY_RE
from trainer.errors import EngineStartError
from trainer.vocabulary import exception_leaves, raise_first

__all__ = [
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "EngineProcess",
    "EngineProcesses",
    "ReferenceServers",
    "ServerSpec",
    "ServersSpec",
    "base_url",
    "launch_local_engines",
    "open_engine_processes",
    "server_device",
    "server_env",
]

#: Seconds a server gets to load its model and answer ``/health``.
DEFAULT_STARTUP_TIMEOUT_S = 180.0
#: Seconds between SIGTERM and SIGKILL when stopping a server.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
#: Characters of a server's log carried by ``EngineStartError``.
LOG_TAIL_CHARS = 4000

_POLL_S = 0.05
_PROJECT_ROOT = Path(__file__).resolve().parent.parent


@attrs.define(eq=False)
class EngineProcess:
    """One server process the trainer started."""

    #: Position in the group (``engine-I.log``).
    index: int
    #: The trio process (its own process group: ``pgid == pid``).
    process: trio.Process
    #: Where its stdout and stderr go.
    log_path: Path
    #: ``http://HOST:PORT`` once it is ready; a placeholder naming the process before that.
    url: str
    #: True once it answered ``/health``.
    ready: bool = False
    #: Size of the (appended) log when this process started: only what follows is its own.
    log_offset: int = 0
    #: The port it was told to use; None: read from its ``ENGINE_READY`` line.
    port: int | None = None

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


@attrs.frozen
class ServerSpec:
    """How to start one server: its command line, what it adds to the environment, its port."""

    argv: tuple[str, ...]
    #: Set on top of the launcher's environment (``CUDA_VISIBLE_DEVICES``, ``VLLM_*``).
    env: Mapping[str, str] = attrs.field(factory=dict)
    #: The port it will listen on; None: it picks one and prints ``ENGINE_READY port=N``.
    port: int | None = None


class ServersSpec(Protocol):
    """Makes server ``index``'s :class:`ServerSpec`, listening on ``host`` (picklable for Ray)."""

    def __call__(self, index: int, host: str) -> ServerSpec: ...


@attrs.frozen
class ReferenceServers:
    """``python -m engines.local serve`` servers (the reference engine): server ``I`` gets seed
    ``seed + I`` and ``devices[I % len(devices)]`` (none: the server's default, ``auto``)."""

    model_dir: str | None = None
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    devices: tuple[str, ...] = ()
    #: ``--enable-sleep-mode``: the run sleeps its engines (without it ``/sleep`` is refused).
    enable_sleep_mode: bool = False
    #: ``--num-threads``: torch's intra-op threads per server (None: the server's default, 1).
    num_threads: int | None = None

    def __call__(self, index: int, host: str) -> ServerSpec:
        cmd = [sys.executable, "-m", "engines.local", "serve", "--host", host, "--port", "0"]
        cmd += ["--seed", str(self.seed + index), "--exit-on-stdin-eof"]
        if self.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
        if self.num_threads is not None:
            cmd += ["--num-threads", str(self.num_threads)]
        if self.model_dir is not None:
            cmd += ["--model", str(self.model_dir)]
        device = self.devices[index % len(self.devices)] if self.devices else None
        flags, env = server_device(device, os.environ)
        return ServerSpec((*cmd, *self.extra_args, *flags), env)


def server_env(env: Mapping[str, str] | None, api_key: str | None) -> dict[str, str]:
    child = dict(os.environ if env is None else env)
    # The server imports ``engines`` and ``trainer`` from this checkout even when not installed.
    paths = [str(_PROJECT_ROOT), *filter(None, child.get("PYTHONPATH", "").split(os.pathsep))]
    child["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if api_key is not None:
        child["VLLM_API_KEY"] = api_key
    return child


async def _spawn(
    index: int, spec: ServerSpec, host: str, log_path: Path, env: dict[str, str]
) -> EngineProcess:
    log_file = await trio.to_thread.run_sync(lambda: open(log_path, "ab"))  # noqa: SIM115
    offset = log_file.seek(0, 2)
    try:
        process = await trio.lowlevel.open_process(
            list(spec.argv),
            stdin=subprocess.PIPE,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**env, **spec.env},
        )
    finally:
        log_file.close()  # the child holds its own descriptor
    url = f"engine-{index} (pid {process.pid})" if spec.port is None else base_url(host, spec.port)
    return EngineProcess(index, process, log_path, url, log_offset=offset, port=spec.port)


def base_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def _wait_ready(
    engine: EngineProcess, host: str, api_key: str | None, http: httpx.AsyncClient
) -> None:
    """Wait for the ready line (a server that picks its port), then for ``/health`` 200;
    raise if the process exits first."""

    async def died() -> EngineStartError:
        code = engine.process.returncode
        how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return EngineStartError(
            engine.url, f"exited during start-up ({how})", await engine.log_tail()
        )

    while engine.port is None:
        if engine.process.poll() is not None:
            raise await died()
        match = READY_RE.search(await engine.log_tail(chars=1 << 20))
        if match:
            engine.url = base_url(host, int(match.group(1)))
            break
        await trio.sleep(_POLL_S)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    while True:
        if engine.process.poll() is not None:
            raise await died()
        try:
            response = await http.get(f"{engine.url}/health", headers=headers)
            if response.status_code == 200:
                engine.ready = True
                return
        except httpx.TransportError:
            pass
        await trio.sleep(_POLL_S)


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
        api_key: str | None,
        startup_timeout_s: float,
        shutdown_timeout_s: float,
    ) -> None:
        super().__init__()
        self.servers = servers
        self.log_dir = log_dir
        self.host = host
        self.env = env
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_timeout_s = shutdown_timeout_s

    async def spawn(self, index: int) -> EngineProcess:
        """Start server ``index`` (not waited for), appending to ``engine-I.log``."""
        spec = self.servers(index, self.host)
        log_path = self.log_dir / f"engine-{index}.log"
        return await _spawn(index, spec, self.host, log_path, self.env)

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
        async with httpx.AsyncClient(timeout=5.0) as http:
            with trio.move_on_after(self.startup_timeout_s) as scope:
                await _wait_ready(engine, self.host, self.api_key, http)
        if scope.cancelled_caught:
            raise EngineStartError(
                engine.url,
                f"not healthy within {self.startup_timeout_s:g}s of its restart",
                await engine.log_tail(),
            )
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
) -> AsyncIterator[EngineProcesses]:
    """Start ``num_engines`` servers, wait until all are healthy, yield them; always stop them.

    Server ``I`` is ``servers(I, host)`` (a :class:`ServerSpec`), logs to
    ``log_dir/engine-I.log`` (appended), and gets ``env`` (default: this process's), the
    project on ``PYTHONPATH``, ``VLLM_API_KEY`` when ``api_key`` is set, and its spec's own
    variables. Raises ``EngineStartError`` (with the log tail) when a server exits during
    start-up or is not healthy within ``startup_timeout_s``; several failures raise the
    first, the others as notes. ``ValueError`` for ``num_engines < 1``. Stopping is shielded
    and bounded by about ``shutdown_timeout_s + 5`` seconds whatever the cancellation state.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be at least 1, got {num_engines}")
    log_dir = Path(log_dir)
    await trio.Path(log_dir).mkdir(parents=True, exist_ok=True)
    child_env = server_env(env, api_key)
    engines = EngineProcesses(
        servers, log_dir, host, child_env, api_key, startup_timeout_s, shutdown_timeout_s
    )
    try:
        for i in range(num_engines):
            engines.append(await engines.spawn(i))
        async with httpx.AsyncClient(timeout=5.0) as http:
            with trio.move_on_after(startup_timeout_s) as scope:
                try:
                    async with trio.open_nursery() as nursery:
                        for engine in engines:
                            nursery.start_soon(_wait_ready, engine, host, api_key, http)
                except BaseExceptionGroup as group:
                    _, errors = group.split(trio.Cancelled)
                    if errors is None:
                        raise
                    raise_first(exception_leaves(errors))
            if scope.cancelled_caught:
                slow = next((e for e in engines if not e.ready), engines[0])
                raise EngineStartError(
                    slow.url, f"not healthy within {startup_timeout_s:g}s", await slow.log_tail()
                )
        yield engines
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for engine in engines:
                    nursery.start_soon(_stop, engine, shutdown_timeout_s)


def server_device(device: str | None, env: Mapping[str, str]) -> tuple[list[str], dict[str, str]]:
    """The ``--device`` flag and the variables to set for a reference server on ``device``:
    ``cuda:N`` becomes ``--device cuda`` with GPU ``N`` (of those visible in ``env``) its only
    visible GPU."""
    if device is None:
        return [], {}
    if not device.startswith("cuda:"):
        return ["--device", device], {}
    index = int(device.split(":", 1)[1])
    visible = env.get("CUDA_VISIBLE_DEVICES")
    physical = visible.split(",")[index].strip() if visible else str(index)
    return ["--device", "cuda"], {"CUDA_VISIBLE_DEVICES": physical}


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
) -> AsyncIterator[list[str]]:
    """:func:`open_engine_processes` of :class:`ReferenceServers`, yielding the servers' base
    URLs (``http://HOST:PORT``). A server on ``cuda:N`` sees that GPU alone
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
    ) as engines:
        yield [e.url for e in engines]
