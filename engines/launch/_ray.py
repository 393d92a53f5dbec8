"""``engine.placement=ray``: the trainer's engine servers, each in a Ray actor.

::

    async with open_ray_engines(2, ReferenceServers(model_dir), run_dir / "engines") as engines:
        client = InferenceClient([e.url for e in engines])

Each server is the same process as with ``engine.placement=process`` (``servers(I, node_ip)``
makes its :class:`~engines.launch.ServerSpec`, on its node), started by an
:class:`~engines.launch.EngineServerActor` on the node Ray picks (``SPREAD``: one engine per
node while nodes last). An actor reserves ``num_cpus`` CPUs and ``num_gpus`` GPUs (a
``vllm serve`` of ``engine.tensor_parallel_size`` ranks asks for that many, on one node); Ray
sets its ``CUDA_VISIBLE_DEVICES`` to them, and its server inherits it. The server binds that
node's IP address (the one Ray uses) and the trainer reaches it over HTTP there, exactly as
it reaches a local server: start-up is the launchers' one wait
(:func:`~engines.launch._ready.wait_all_ready`), its ready line and exit status asked of the
actor, its ``/health`` asked by the trainer, so a node the trainer cannot reach fails at
start, not in the first step.

Lifetimes, on every path:

- leaving the block (normally, on an error or on cancellation) asks each actor to stop
  its server (stdin closed, SIGTERM to its process group, SIGKILL after
  ``shutdown_timeout_s``) and then kills the actor; shielded and bounded;
- an actor that dies (``ray.kill``, its node lost, the trainer's driver gone so Ray
  reaps the actors it owned) closes the server's stdin pipe, and the server (started with
  ``--exit-on-stdin-eof``, or under :mod:`engines.launch.stdin_guard`) shuts itself down.

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
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from engines.launch._ray_actor import EngineServerActor
from engines.launch._ready import wait_all_ready
from engines.launch._spec import (
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    ServersSpec,
    new_api_key,
)
from engines.launch._stop import KILL_WAIT_S
from trainer.errors import EngineStartError
from trainer.vocabulary import get_refs_as_completed

__all__ = ["RayEngine", "open_ray_engines"]

log = logging.getLogger("engines.launch")

#: Seconds between questions to a starting server (each is a Ray call, or an HTTP request).
_POLL_S = 0.25
#: Seconds an actor may take to answer a question about its server.
_ASK_TIMEOUT_S = 5.0
#: The trainer's own health check always gets at least this long, even when the actors'
#: start took the whole budget (so "not reachable" is never reported untried).
_MIN_HEALTH_S = 5.0


def _ask(actor: Any, method: str) -> Any:
    """``actor.method()``, waited for (blocks; call it off the trio thread)."""
    import ray  # heavy: imported only where Ray places engines

    return ray.get(getattr(actor, method).remote(), timeout=_ASK_TIMEOUT_S)


@attrs.define(eq=False)
class RayEngine:
    """One server placed by Ray, as the trainer sees it."""

    index: int
    #: The :class:`EngineServerActor` handle.
    actor: Any
    #: ``http://NODE_IP:PORT`` once its port is known; a placeholder before that.
    url: str = ""
    #: The server's process id on its node (the actor's is ``actor_pid``).
    pid: int | None = None
    actor_pid: int | None = None
    node_ip: str | None = None
    #: Where the server logs, on its node.
    log_path: str | None = None
    #: True once it answered the trainer's ``/health``.
    ready: bool = False
    #: The server's secret (``Authorization: Bearer``), the same for every engine of a launch.
    api_key: str | None = None

    @property
    def host(self) -> str:
        assert self.node_ip is not None, "asked before the actor started the server"
        return self.node_ip

    async def _ask(self, method: str) -> Any:
        return await trio.to_thread.run_sync(_ask, self.actor, method, abandon_on_cancel=True)

    async def port(self) -> int | None:
        try:
            return await self._ask("port")
        except TimeoutError:  # a busy actor: asked again
            return None

    async def exit_status(self) -> str | None:
        from ray.exceptions import RayActorError  # heavy: see _ask

        try:
            return await self._ask("exit_status")
        except RayActorError as exc:
            return f"its Ray actor died: {exc}"
        except TimeoutError:
            return None

    async def log_tail(self) -> str:
        """The server's log tail from its node ("" when the actor does not answer)."""
        try:
            return await self._ask("log_tail")
        except Exception:
            return ""


def _spawn(
    engines: list[RayEngine],
    num_engines: int,
    args: tuple[Any, ...],
    resources: tuple[float, float],
    env: dict[str, str],
) -> None:
    """Create the actors (GCS round-trips: called off the trio thread)."""
    import ray  # heavy: imported only where Ray places engines

    log_dir, servers, api_key, (weight_dir, hosts) = args
    log_dir = os.path.abspath(log_dir)  # the same path on every node
    weight_dir = None if weight_dir is None else os.path.abspath(weight_dir)
    num_cpus, num_gpus = resources
    cls = ray.remote(EngineServerActor).options(
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        max_concurrency=4,
        scheduling_strategy="SPREAD",
        runtime_env={"env_vars": env},
    )
    for i in range(num_engines):
        actor = cls.remote(i, log_dir, servers, api_key, weight_dir, hosts)
        engines.append(RayEngine(i, actor, url=f"engine-{i} (ray actor)", api_key=api_key))


def _timeout_error(engines: list[RayEngine], refs: list[Any], timeout_s: float) -> EngineStartError:
    """Why the actors' start ran out of time: an actor never placed (blocks)."""
    import ray  # heavy: imported only where Ray places engines

    for engine, ref in zip(engines, refs):
        if not ray.wait([ref], timeout=0)[0]:
            return EngineStartError(
                engine.url,
                f"not placed or not started within {timeout_s:g}s: does the Ray cluster have "
                "engine.ray_num_cpus free for every engine (and, for vLLM, "
                "engine.tensor_parallel_size GPUs on one node)? (`ray status` shows what is free)",
            )
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
        created, _ = ray.wait(pings, num_returns=len(pings), timeout=_ASK_TIMEOUT_S)
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


async def _start(engines: list[RayEngine], timeout_s: float, api_key: str | None) -> None:
    """Start every server and wait for it to answer the trainer, within ``timeout_s``."""
    started = time.monotonic()
    refs = [e.actor.start.remote() for e in engines]

    def failed(i: int, error: BaseException) -> BaseException:
        return _start_error(engines[i], error)

    try:
        infos = await trio.to_thread.run_sync(
            get_refs_as_completed, refs, timeout_s, failed, abandon_on_cancel=True
        )
    except TimeoutError:  # ray's GetTimeoutError: some actor was not placed or not started
        raise await trio.to_thread.run_sync(_timeout_error, engines, refs, timeout_s) from None
    for engine, info in zip(engines, infos):
        engine.pid, engine.actor_pid = info["pid"], info["actor_pid"]
        engine.node_ip, engine.log_path = info["node_ip"], info["log_path"]
        engine.url = f"engine-{engine.index} (pid {engine.pid} on {engine.node_ip})"

    def not_ready(engine: RayEngine) -> str:
        if engine.url.startswith("http"):
            return (
                f"started on node {engine.node_ip} but not healthy from the trainer within "
                f"{timeout_s:g}s: the trainer must reach every node's IP, and a server "
                "still loading its model needs a longer engine.startup_timeout_s"
            )
        return f"not listening within {timeout_s:g}s"

    left = max(_MIN_HEALTH_S, timeout_s - (time.monotonic() - started))
    await wait_all_ready(engines, api_key, left, not_ready, poll_s=_POLL_S)


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
    weight_dir: str | Path | None = None,
    weight_sync_hosts: Sequence[str] = (),
) -> AsyncIterator[list[RayEngine]]:
    """Start ``num_engines`` servers in Ray actors, yield them healthy; always stop them.

    Needs a connected Ray driver (``ray.init``). Server ``I`` is ``servers(I, node_ip)`` and
    logs to ``log_dir/engine-I.log`` on its node (a temp directory there when ``log_dir``
    cannot be created on it); ``log_dir`` is made absolute here so every node reads it the
    same way. Raises ``EngineStartError`` as described in the module docstring;
    ``env`` is added to each actor's environment (``runtime_env``), and so to its server's:
    the trainer passes its fault spec and import path this way. Each server gets
    ``VLLM_API_KEY`` (``api_key``, or a fresh secret when it is None; every
    :class:`RayEngine` carries it as ``api_key``), ``TRAINER_WEIGHT_DIR`` and
    ``TRAINER_WEIGHT_SYNC_HOSTS`` as :func:`~engines.launch.open_engine_processes` gives them,
    set by its actor (the secret is an argument of the actor, never a server's argv).
    ``ValueError`` for ``num_engines < 1`` or a non-positive ``startup_timeout_s``.
    """
    if num_engines < 1:
        raise ValueError(f"num_engines must be at least 1, got {num_engines}")
    if not math.isfinite(startup_timeout_s) or startup_timeout_s <= 0:
        raise ValueError(f"startup_timeout_s must be a positive number, got {startup_timeout_s}")
    api_key = new_api_key() if api_key is None else api_key
    trust = (None if weight_dir is None else str(weight_dir), tuple(weight_sync_hosts))
    args = (str(log_dir), servers, api_key, trust)
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
