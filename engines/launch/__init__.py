"""Start and stop the engine servers the trainer owns: one launcher, whatever the server,
wherever it runs.

::

    async with launch_local_engines(2, model_dir, run_dir / "engines", seed=0) as urls:
        client = InferenceClient(urls)
    async with open_engine_processes(2, VllmServers(model_dir, ...), run_dir / "engines") as engines:
        ...
    async with open_ray_engines(2, ReferenceServers(model_dir), run_dir / "engines") as engines:
        ...

- what a server is: a :class:`ServerSpec` (command line, environment, port) per server, made
  by a :class:`ServersSpec` (:class:`ReferenceServers`; :class:`engines.vllm.VllmServers`);
- where it runs: a child process of the trainer (:func:`open_engine_processes`,
  ``engine.placement=process``) or a process started by a Ray actor on the node Ray picks
  (:func:`open_ray_engines`, ``engine.placement=ray``);
- when it is ready, for both: its ``ENGINE_READY port=N`` line (a server given ``--port 0``)
  or the port it was told, then ``GET /health`` from the trainer, bounded by
  ``startup_timeout_s``; a server that exits first, or is not healthy in time, raises
  :class:`~trainer.errors.EngineStartError` with the tail of its log;
- who may drive it, for both: the holder of its secret (``VLLM_API_KEY`` in its environment,
  never on its command line: the caller's ``api_key``, or a fresh one per launch, exposed
  as ``api_key`` on what the launcher yields); its weight folder (``TRAINER_WEIGHT_DIR``)
  and the weight-sync hosts it may join (``TRAINER_WEIGHT_SYNC_HOSTS``), when given;
- how it stops, for both: stdin closed, SIGTERM to its process group, SIGKILL after
  ``shutdown_timeout_s``; shielded and bounded on every way out of the block;
- why it never outlives the trainer: the kernel kills it when the trainer dies, however it
  dies and from the server's first instruction (:func:`open_child` runs it under
  :mod:`engines.launch.parent_death`; a fork server kills a fork whose client is gone); and a
  pipe on its stdin, which closes when the trainer dies: the reference server exits on its
  end-of-file, ``vllm serve`` runs under :mod:`engines.launch.stdin_guard`, which does it for
  it. A Ray-placed server is its actor's child, and the actor is Ray's: it ends with its
  actor, which Ray ends with the job (``engines.launch._ray``).

- what starts it: a new process, or a fork of a fork server that imported everything once
  (:mod:`engines.launch.fork_server`, ``fork_server=``; its clients :func:`fork_process` and
  :func:`fork_popen`).

The private modules: ``_children`` (children that die with this process), ``_spec`` (the specs), ``_fork_client`` (a fork server's clients), ``_ready`` (the ready line, the one start-up
wait), ``_stop`` (the SIGTERM/SIGKILL escalation), ``_processes`` (child processes),
``_ray`` and ``_ray_actor`` (Ray placement: the trainer's side, the actor's side).
"""

from engines.launch._children import ChildProcess, open_child
from engines.launch._fork_client import (
    FORK_SERVER_READY,
    ForkedPopen,
    ForkedProcess,
    fork_popen,
    fork_process,
    forkable,
    list_children,
)
from engines.launch._processes import (
    EngineProcess,
    EngineProcesses,
    EngineUrls,
    launch_local_engines,
    open_engine_processes,
)
from engines.launch._ray import RayEngine, open_ray_engines
from engines.launch._ray_actor import EngineServerActor
from engines.launch._ready import READY_PREFIX, READY_RE, ready_line
from engines.launch._spec import (
    API_KEY_ENV,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    LOG_TAIL_CHARS,
    WEIGHT_DIR_ENV,
    WEIGHT_SYNC_HOSTS_ENV,
    ReferenceServers,
    ServerSpec,
    ServersSpec,
    base_url,
    new_api_key,
    server_device,
    server_env,
)
from engines.launch._stop import KILL_WAIT_S

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "FORK_SERVER_READY",
    "KILL_WAIT_S",
    "LOG_TAIL_CHARS",
    "READY_PREFIX",
    "READY_RE",
    "WEIGHT_DIR_ENV",
    "WEIGHT_SYNC_HOSTS_ENV",
    "ChildProcess",
    "EngineProcess",
    "EngineProcesses",
    "EngineServerActor",
    "EngineUrls",
    "ForkedPopen",
    "ForkedProcess",
    "RayEngine",
    "ReferenceServers",
    "ServerSpec",
    "ServersSpec",
    "base_url",
    "fork_popen",
    "fork_process",
    "forkable",
    "launch_local_engines",
    "list_children",
    "new_api_key",
    "open_child",
    "open_engine_processes",
    "open_ray_engines",
    "ready_line",
    "server_device",
    "server_env",
]
