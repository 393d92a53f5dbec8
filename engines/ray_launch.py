"""``engine.placement=ray``: the trainer's engine servers, each in a Ray actor.

::

    async with open_ray_engines(2, ReferenceServers(model_dir), run_dir / "engines") as engines:
        client = InferenceClient([e.url for e in engines])

Each server is the same process as with ``engine.placement=process`` (:mod:`engines.launch`:
``servers(I, node_ip)`` makes its :class:`~engines.launch.ServerSpec`, on its node), started
by an :class:`EngineServerActor` on the node Ray picks (``SPREAD``: one engine per node while
nodes last). An actor reserves ``num_cpus`` CPUs and ``num_gpus`` GPUs (a ``vllm serve`` of
``engine.tensor_parallel_size`` ranks asks for that many, on one node); Ray sets its
``CUDA_VISIBLE_DEVICES`` to them, and its server inherits it. The server binds that node's IP address (the one Ray uses) and the trainer
reaches it over HTTP there, exactly as it reaches a local server; start-up ends with the
trainer's own ``GET /health``, so a node the trainer cannot reach fails at start, not in
the first step.

Lifetimes, on every path:

- leaving the block (normally, on an error or on cancellation) asks each actor to stop
  its server (stdin closed, SIGTERM to its process group, SIGKILL after
  ``shutdown_timeout_s``) and then kills the actor; shielded and bounded;
- an actor that dies (``ray.kill``, its node lost, the trainer's driver gone so Ray
  reaps the actors it owned) closes the server's stdin pipe, and the server (started with
  ``--exit-on-stdin-eof``, or under :mod:`engines.stdin_guard`) shuts itself down.

Start-up is bounded by ``startup_timeout_s`` from the first actor request to the last
healthy server, placement included (a cluster without ``num_cpus`` free CPUs per engine
fails with an :class:`~trainer.errors.EngineStartError` saying so), plus at least 5 s for
the trainer's own health check. A server that exits during start-up (before its ready line,
or before it is healthy) raises ``EngineStartError`` with its log tail, read on its node.
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import httpx
import trio

from engines.launch import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    LOG_TAIL_CHARS,
    ServersSpec,
    base_url,
    server_env,
)
from engines.process_stop import KILL_WAIT_S, stop_group_blocking
from engines.ready_line import READY_RE
from trainer.errors import EngineStartError
from trainer.vocabulary import get_refs_as_completed

__all__ = ["EngineServerActor", "RayEngine", "open_ray_engines"]

log = logging.getLogger("engines.ray_launch")

_POLL_S = 0.05
#: Seconds a dead server's log tail may take to arrive from its node.
_TAIL_TIMEOUT_S = 5.0
#: The trainer's own health check always gets at least this long, even when the actors'
#: start took the whole budget (so "not reachable" is never reported untried).
_MIN_HEALTH_S = 5.0
#: Seconds between asking an actor whether its server exited, while waiting for health.
_EXIT_POLL_S = 1.0


class EngineServerActor:
    """Inside the actor: starts one server process on this node and stops it on request.

    Runs as a threaded actor (``max_concurrency`` > 1) so that ``log_tail`` answers while
    ``start`` is still waiting for the server.
    """

    def __init__(
        self,
        index: int,
        log_dir: str,
        servers: ServersSpec,
        api_key: str | None,
    ) -> None:
        self.name = f"engine-{index}"
        self._index = index
        self._log_path = self._choose_log_path(Path(log_dir) / f"{self.name}.log")
        self._servers = servers
        self._api_key = api_key
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_offset = 0
        self._lock = threading.Lock()
        #: Set by ``stop``: a ``start`` that has not launched the server yet never will.
        self._stopping = False

    @staticmethod
    def _choose_log_path(wanted: Path) -> Path:
        """``wanted`` when its directory can be made on this node, else a temp directory."""
        try:
            wanted.parent.mkdir(parents=True, exist_ok=True)
            return wanted
        except OSError:
            fallback = Path(tempfile.gettempdir()) / "trainer-engines" / wanted.name
            fallback.parent.mkdir(parents=True, exist_ok=True)
            return fallback

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """What this run's server wrote to its log, the last ``chars`` characters."""
        try:
            data = self._log_path.read_bytes()
        except OSError:
            return ""
        return data[self._log_offset :].decode(errors="replace")[-chars:]

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Start the server, wait for its ready line; its URL, pids, node and log path."""
        import ray  # heavy: imported only where Ray places engines

        host = ray.util.get_node_ip_address()
        spec = self._servers(self._index, host)
        with self._lock, open(self._log_path, "ab") as log_file:
            if self._stopping:
                raise EngineStartError(f"{self.name} on {host}", "stopped during start-up")
            self._log_offset = log_file.seek(0, 2)
            self._proc = subprocess.Popen(
                list(spec.argv),
                stdin=subprocess.PIPE,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**server_env(None, self._api_key), **spec.env},
            )
        proc = self._proc
        placeholder = f"{self.name} (pid {proc.pid} on {host})"
        end = time.monotonic() + timeout_s
        port = spec.port
        while port is None:
            if match := READY_RE.search(self.log_tail(chars=1 << 20)):
                port = int(match.group(1))
                break
            if (how := self.exit_status()) is not None:
                raise EngineStartError(
                    placeholder, f"exited during start-up ({how})", self.log_tail()
                )
            if time.monotonic() > end:
                raise EngineStartError(
                    placeholder, f"not listening within {timeout_s:g}s", self.log_tail()
                )
            time.sleep(_POLL_S)
        return {
            "url": base_url(host, port),
            "pid": proc.pid,
            "actor_pid": os.getpid(),
            "node_ip": host,
            "log_path": str(self._log_path),
        }

    def exit_status(self) -> str | None:
        """How the server ended ("exit code N", "signal N"); None while it runs (or before)."""
        code = None if self._proc is None else self._proc.poll()
        if code is None:
            return None
        return f"signal {-code}" if code < 0 else f"exit code {code}"

    def stop(self, timeout_s: float) -> int | None:
        """Close stdin, SIGTERM the server's group, SIGKILL it after ``timeout_s``; its code."""
        with self._lock:
            self._stopping = True
            proc = self._proc
        if proc is None:
            return None
        if proc.stdin is not None:
            try:
                proc.stdin.close()
            except OSError:
                pass

        def exited(wait_s: float) -> bool:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                return False
            return True

        stop_group_blocking(proc.pid, timeout_s, exited)
        return proc.returncode


@attrs.define(eq=False)
class RayEngine:
    """One server placed by Ray, as the trainer sees it."""

    index: int
    #: The :class:`EngineServerActor` handle.
    actor: Any
    #: ``http://NODE_IP:PORT`` once started; a placeholder before that.
    url: str = ""
    #: The server's process id on its node (the actor's is ``actor_pid``).
    pid: int | None = None
    actor_pid: int | None = None
    node_ip: str | None = None
    #: Where the server logs, on its node.
    log_path: str | None = None


def _spawn(
    engines: list[RayEngine],
    num_engines: int,
    args: tuple[Any, ...],
    resources: tuple[float, float],
    env: dict[str, str],
) -> None:
    """Create the actors (GCS round-trips: called off the trio thread)."""
    import ray  # heavy: imported only where Ray places engines

    log_dir, servers, api_key = args
    log_dir = os.path.abspath(log_dir)  # the same path on every node
    num_cpus, num_gpus = resources
    cls = ray.remote(EngineServerActor).options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_concurrency=4,
        scheduling_strategy="SPREAD",
        runtime_env={"env_vars": env},
    )
    for i in range(num_engines):
        actor = cls.remote(i, log_dir, servers, api_key)
        engines.append(RayEngine(i, actor, url=f"engine-{i} (ray actor)"))


def _tail(engine: RayEngine) -> str | None:
    """The server's log tail from its node; None when the actor does not answer (blocks)."""
    import ray  # heavy: imported only where Ray places engines

    try:
        return ray.get(engine.actor.log_tail.remote(), timeout=_TAIL_TIMEOUT_S)
    except Exception:
        return None


def _timeout_error(engines: list[RayEngine], refs: list[Any], timeout_s: float) -> EngineStartError:
    """Why start-up ran out of time: an actor never placed, or a server never listening."""
    import ray  # heavy: imported only where Ray places engines

    for engine, ref in zip(engines, refs):
        if ray.wait([ref], timeout=0)[0]:
            continue
        tail = _tail(engine)
        if tail is None:
            return EngineStartError(
                engine.url,
                f"not placed or not started within {timeout_s:g}s: does the Ray cluster have "
                "engine.ray_num_cpus free for every engine (and, for vLLM, "
                "engine.tensor_parallel_size GPUs on one node)? (`ray status` shows what is free)",
            )
        return EngineStartError(engine.url, f"not listening within {timeout_s:g}s", tail)
    return EngineStartError(engines[0].url, f"not started within {timeout_s:g}s")


def _start_error(engine: RayEngine, error: BaseException) -> EngineStartError:
    """``EngineStartError`` for an actor whose ``start`` failed (the server's own, if any)."""
    from ray.exceptions import RayActorError, RayTaskError  # heavy: see above

    if isinstance(error, RayTaskError) and isinstance(error.cause, EngineStartError):
        return error.cause
    if isinstance(error, RayActorError):  # incl. ActorUnavailableError: not retried here
        return EngineStartError(engine.url, f"its Ray actor failed during start-up: {error}")
    return EngineStartError(engine.url, f"start failed: {type(error).__name__}: {error}")


def _stop_all(engines: list[RayEngine], shutdown_timeout_s: float) -> None:
    """Stop every server through its actor (bounded), then kill the actors (blocks).

    Only actors that exist are asked: a stop queued behind an actor still waiting for
    room would wait for nothing (such an actor has no server; killing it is enough). A
    Ray failure in one phase is logged and never skips the kills.
    """
    import ray  # heavy: imported only where Ray places engines

    try:
        pings = [e.actor.__ray_ready__.remote() for e in engines]
        created, _ = ray.wait(pings, num_returns=len(pings), timeout=_TAIL_TIMEOUT_S)
        refs = [
            e.actor.stop.remote(shutdown_timeout_s) for e, p in zip(engines, pings) if p in created
        ]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=shutdown_timeout_s + KILL_WAIT_S + 1.0)
    except Exception as exc:  # the actors die below; their servers see stdin close
        log.warning("stopping the engine servers through their actors failed: %r", exc)
    for engine in engines:
        try:
            ray.kill(engine.actor, no_restart=True)
        except Exception as exc:  # gone already
            log.debug("ray.kill(engine-%d): %r", engine.index, exc)


def _exit_status(engine: RayEngine) -> str | None:
    """How the server ended, asked of its actor (blocks); None while it runs or no answer."""
    import ray  # heavy: imported only where Ray places engines

    try:
        return ray.get(engine.actor.exit_status.remote(), timeout=_TAIL_TIMEOUT_S)
    except Exception:
        return None


async def _wait_healthy(engine: RayEngine, api_key: str | None, http: httpx.AsyncClient) -> None:
    """Poll ``GET /health`` from the trainer until 200 (cancelled by the start-up bound);
    ``EngineStartError`` with its log tail when the server exits first (a server told its
    port, such as ``vllm serve``, is still loading its model here)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    last_asked = time.monotonic()
    while True:
        try:
            response = await http.get(f"{engine.url}/health", headers=headers)
            if response.status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() - last_asked > _EXIT_POLL_S:
            last_asked = time.monotonic()
            how = await trio.to_thread.run_sync(_exit_status, engine, abandon_on_cancel=True)
            if how is not None:
                tail = await trio.to_thread.run_sync(_tail, engine, abandon_on_cancel=True)
                raise EngineStartError(engine.url, f"exited during start-up ({how})", tail or "")
        await trio.sleep(_POLL_S)


async def _start(engines: list[RayEngine], timeout_s: float, api_key: str | None) -> None:
    """Start every server and wait for it to answer the trainer, within ``timeout_s``."""
    started = time.monotonic()
    refs = [e.actor.start.remote(timeout_s) for e in engines]

    def failed(i: int, error: BaseException) -> BaseException:
        return _start_error(engines[i], error)

    try:
        infos = await trio.to_thread.run_sync(
            get_refs_as_completed, refs, timeout_s, failed, abandon_on_cancel=True
        )
    except TimeoutError:  # ray's GetTimeoutError: some actor was not placed or not started
        raise await trio.to_thread.run_sync(_timeout_error, engines, refs, timeout_s) from None
    for engine, info in zip(engines, infos):
        engine.url, engine.pid, engine.actor_pid = info["url"], info["pid"], info["actor_pid"]
        engine.node_ip, engine.log_path = info["node_ip"], info["log_path"]
    left = max(_MIN_HEALTH_S, timeout_s - (time.monotonic() - started))
    async with httpx.AsyncClient(timeout=5.0) as http:
        for engine in engines:
            with trio.move_on_after(left) as scope:
                await _wait_healthy(engine, api_key, http)
            if scope.cancelled_caught:
                raise EngineStartError(
                    engine.url,
                    f"started on node {engine.node_ip} but not healthy from the trainer within "
                    f"{timeout_s:g}s: the trainer must reach every node's IP, and a server "
                    "still loading its model needs a longer engine.startup_timeout_s",
                    await trio.to_thread.run_sync(_tail, engine) or "",
                )
            left = max(_MIN_HEALTH_S, timeout_s - (time.monotonic() - started))


@asynccontextmanager
async def open_ray_engines(
    num_engines: int,
    servers: ServersSpec,
    log_dir: str | Path,
    *,
    api_key: str | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    env: Mapping[str, str] | None = None,
) -> AsyncIterator[list[RayEngine]]:
    """Start ``num_engines`` servers in Ray actors, yield them healthy; always stop them.

    Needs a connected Ray driver (``ray.init``). Server ``I`` is ``servers(I, node_ip)`` and
    logs to ``log_dir/engine-I.log`` on its node (a temp directory there when ``log_dir``
    cannot be created on it); ``log_dir`` is made absolute here so every node reads it the
    same way. Raises ``EngineStartError`` as described in the module docstring;
    ``env`` is added to each actor's environment (``runtime_env``), and so to its server's:
    the trainer passes its fault spec and import path this way. ``ValueError`` for
    ``num_engines < 1`` or a non-positive ``startup_timeout_s``.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be at least 1, got {num_engines}")
    if not math.isfinite(startup_timeout_s) or startup_timeout_s <= 0:
        raise ValueError(f"startup_timeout_s must be a positive number, got {startup_timeout_s}")
    args = (str(log_dir), servers, api_key)
    resources = (num_cpus, num_gpus)
    engines: list[RayEngine] = []
    try:
        await trio.to_thread.run_sync(
            _spawn, engines, num_engines, args, resources, dict(env or {})
        )
        await _start(engines, startup_timeout_s, api_key)
        yield engines
    finally:
        bound = shutdown_timeout_s + 15.0
        with trio.move_on_after(bound, shield=True) as scope:
            await trio.to_thread.run_sync(
                _stop_all, list(engines), shutdown_timeout_s, abandon_on_cancel=True
            )
        if scope.cancelled_caught:
            log.warning("stopping the Ray-placed engines did not finish in %.0fs", bound)
