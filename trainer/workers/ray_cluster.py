"""Starting (or joining) the Ray cluster the Ray worker backend runs on, reliably.

Why start-up needs care: the raylet waits a fixed ~15 s for its dashboard agent to write
its port files and aborts the node when it does not (ray-project/ray#65983); on a slow,
shared two-core machine the agent's start-up competes with every other process Ray starts
at once. What we do about it, in order of effect:

- depend on ``ray`` core, not ``ray[default]``: without the dashboard dependencies the
  raylet starts its agent with ``--minimal`` (no HTTP server, no OpenTelemetry/Prometheus
  exporters to import), which is most of the agent's start-up time;
- ``include_dashboard=False``: no dashboard head process importing the same modules at the
  same moment;
- ``RAY_enable_worker_prestart=0``: the raylet does not fork one idle Python worker per CPU
  while the agent starts (ours are started on demand, as actors);
- ``RAY_USAGE_STATS_ENABLED=0``: no usage-stats prompt or report on start-up.

A cluster the trainer starts asks every caller for a token (Ray's token authentication,
``RAY_AUTH_MODE=token``, Ray 2.52 and later): Ray's GCS, raylet and workers listen on every
interface whatever the node address, and without it anyone who reaches one of their ports
can submit work that runs as the trainer's user. The token is made once per process
(:func:`require_token`) and reaches Ray's processes by the environment alone (never a file,
a command line or the run folder); an operator's own ``RAY_AUTH_MODE`` wins, ``disabled``
included. A cluster the trainer joins (``workers.ray_address``) is as its owner started it.

What is left (a machine so busy the agent still misses its window) is retried: only the
cluster start, ``retries`` more times, each failure logged with its reason; a cluster that
cannot start after that raises :class:`RayClusterStartError` with every attempt's reason.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from trainer.errors import RayClusterStartError

__all__ = [
    "ACTOR_ENV_VARS",
    "actor_env",
    "init_kwargs",
    "open_cluster",
    "prepare_env",
    "require_token",
    "start_cluster",
    "stop_cluster",
]

log = logging.getLogger("trainer.workers.ray")

#: Environment the raylet and everything it starts inherit (set only where unset, so an
#: operator's own value wins).
START_ENV = {
    "RAY_enable_worker_prestart": "0",
    "RAY_USAGE_STATS_ENABLED": "0",
    # a worker's stdout/stderr stays in the session's log files, not in the trainer's stderr
    "RAY_DEDUP_LOGS": "0",
}


#: Variables of the trainer's environment every actor gets (fault injection, the test
#: marker that finds a run's processes, the import path of this checkout).
ACTOR_ENV_VARS = ("TRAINER_FAULTS", "TRAINER_FAULTS_FIRED", "TRAINER_TEST_MARKER", "PYTHONPATH")
#: How long disconnecting (and stopping a cluster this run started) may take.
STOP_TIMEOUT_S = 30.0


def actor_env() -> dict[str, str]:
    """``runtime_env["env_vars"]`` for the run's actors: :data:`ACTOR_ENV_VARS` that are set."""
    return {k: os.environ[k] for k in ACTOR_ENV_VARS if k in os.environ}


def prepare_env() -> None:
    """Export :data:`START_ENV` (where unset) before the cluster's processes are started."""
    for key, value in START_ENV.items():
        os.environ.setdefault(key, value)


def require_token() -> None:
    """Turn on Ray's token authentication for the clusters this process starts (module doc):
    ``RAY_AUTH_MODE=token`` and a fresh ``RAY_AUTH_TOKEN``, each only where unset. One token
    per process: Ray caches the token it loaded, so a second cluster started here must use the
    same one."""
    if "RAY_AUTH_MODE" in os.environ:
        return  # the operator's choice
    os.environ["RAY_AUTH_MODE"] = "token"
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")):
        os.environ["RAY_AUTH_TOKEN"] = secrets.token_urlsafe(32)
    ray = sys.modules.get("ray")
    if ray is not None and not ray.is_initialized():
        # Ray read its auth settings when it was imported: have it read them again (as Ray's
        # own tests do). Were these names gone, the cluster's GCS would still ask for the
        # token and ray.init fail loudly: never a cluster without it.
        from ray._raylet import (  # pyright: ignore[reportAttributeAccessIssue]
            AuthenticationTokenLoader,
            Config,
        )

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


def init_kwargs(address: str | None, *, num_cpus: int | None = None) -> dict[str, Any]:
    """The ``ray.init`` arguments the trainer uses (see the module docstring for why)."""
    kwargs: dict[str, Any] = {
        "include_dashboard": False,
        "log_to_driver": False,
        "configure_logging": False,
    }
    if address is None:
        # logical CPUs: enough bundles for the placement group even on a two-core machine
        kwargs["num_cpus"] = max(num_cpus or 0, os.cpu_count() or 1)
    else:
        kwargs["address"] = address
    return kwargs


def start_cluster(address: str | None, *, retries: int, num_cpus: int | None = None) -> bool:
    """Connect to ``address``, or start a local cluster when it is None; blocks.

    Returns whether this call started (and so owns) the cluster. Only starting is retried
    (``retries`` more attempts, a short pause between); joining an existing cluster is not.
    A driver already connected is reused (not owned).
    """
    import ray

    if ray.is_initialized():
        return False
    prepare_env()
    if address is None:
        require_token()  # before the cluster's first process starts: they all inherit it
    attempts = 1 + (retries if address is None else 0)
    reasons: list[str] = []
    for attempt in range(attempts):
        started = time.monotonic()
        try:
            ray.init(**init_kwargs(address, num_cpus=num_cpus))
        except Exception as exc:  # Ray raises bare Exception/ConnectionError/TimeoutError here
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            reasons.append(reason)
            log.warning(
                "ray.init attempt %d/%d failed after %.1fs: %s",
                attempt + 1,
                attempts,
                time.monotonic() - started,
                reason,
            )
            ray.shutdown()  # kill what the failed attempt left behind
            time.sleep(min(2.0 * (attempt + 1), 10.0))
            continue
        log.info("ray.init took %.1fs (attempt %d)", time.monotonic() - started, attempt + 1)
        return address is None
    raise RayClusterStartError(address, attempts, reasons)


def stop_cluster() -> None:
    """Disconnect; a cluster this process started is stopped with it (blocks)."""
    import ray

    ray.shutdown()


@asynccontextmanager
async def open_cluster(
    address: str | None, *, retries: int, num_cpus: int | None = None
) -> AsyncIterator[bool]:
    """:func:`start_cluster` off the trio thread; yields whether this run owns the cluster.

    On exit (whatever the error) the driver disconnects, shielded and bounded by
    :data:`STOP_TIMEOUT_S`; a cluster this run started is stopped with it. A driver that was
    already connected when the run began (a process that runs several runs, each joining
    its cluster) stays connected: the run did not make the connection, so it leaves it.
    """
    import ray

    connected_before = await trio.to_thread.run_sync(ray.is_initialized)
    start = functools.partial(start_cluster, address, retries=retries, num_cpus=num_cpus)
    owned = await trio.to_thread.run_sync(start)
    try:
        yield owned
    finally:
        if not connected_before:
            with trio.move_on_after(STOP_TIMEOUT_S, shield=True) as scope:
                await trio.to_thread.run_sync(stop_cluster, abandon_on_cancel=True)
            if scope.cancelled_caught:
                log.warning("disconnecting from Ray did not finish in %.0fs", STOP_TIMEOUT_S)
            elif owned:
                log.info("stopped the local Ray cluster this run started")
