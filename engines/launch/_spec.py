"""What a server is, for both launchers: its command line, its environment, its port.

A :class:`ServerSpec` per server, made by a :class:`ServersSpec` callable
(:class:`ReferenceServers` here, :class:`engines.vllm.VllmServers` for ``vllm serve``);
:func:`popen_kwargs` is how either launcher turns a spec into a process of its own session
with a pipe on its stdin and its output appended to its log.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Protocol

import attrs

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_STARTUP_TIMEOUT_S",
    "LOG_TAIL_CHARS",
    "WEIGHT_DIR_ENV",
    "WEIGHT_SYNC_HOSTS_ENV",
    "ReferenceServers",
    "ServerSpec",
    "ServersSpec",
    "base_url",
    "new_api_key",
    "popen_kwargs",
    "server_device",
    "server_env",
]

#: Seconds a server gets to load its model and answer ``/health``.
DEFAULT_STARTUP_TIMEOUT_S = 180.0
#: Seconds between SIGTERM and SIGKILL when stopping a server.
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
#: Characters of a server's log carried by ``EngineStartError``.
LOG_TAIL_CHARS = 4000

_PROJECT_ROOT = Path(__file__).resolve().parents[2]

#: The run's secret, which every route but the health probes asks for (``Authorization:
#: Bearer``): the reference server's ``--api-key`` default, vLLM's own (``/v1`` and the like)
#: and :mod:`engines.vllm.auth`'s (every other route of ``vllm serve``).
API_KEY_ENV = "VLLM_API_KEY"
#: The only folder whose files a ``disk`` weight update may read (the run's ``weight_sync/``).
WEIGHT_DIR_ENV = "TRAINER_WEIGHT_DIR"
#: Comma-separated addresses a weight-transfer ``init_info``'s ``master_address`` may name
#: (unset: loopback only).
WEIGHT_SYNC_HOSTS_ENV = "TRAINER_WEIGHT_SYNC_HOSTS"


def new_api_key() -> str:
    """A fresh secret for the servers of one launch (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


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
    #: ``--enable-lora --max-lora-rank N`` and the variable vLLM wants for the LoRA routes
    #: (``sync.lora=adapter``); None: no LoRA.
    max_lora_rank: int | None = None
    #: ``--logprobs-mode`` (None: the server's default, ``raw_logprobs``, as vLLM's).
    logprobs_mode: str | None = None

    def __call__(self, index: int, host: str) -> ServerSpec:
        cmd = [sys.executable, "-m", "engines.local", "serve", "--host", host, "--port", "0"]
        cmd += ["--seed", str(self.seed + index), "--exit-on-stdin-eof"]
        if self.logprobs_mode is not None:
            cmd += ["--logprobs-mode", self.logprobs_mode]
        if self.enable_sleep_mode:
            cmd.append("--enable-sleep-mode")
        if self.num_threads is not None:
            cmd += ["--num-threads", str(self.num_threads)]
        if self.model_dir is not None:
            cmd += ["--model", str(self.model_dir)]
        device = self.devices[index % len(self.devices)] if self.devices else None
        flags, env = server_device(device, os.environ)
        if self.max_lora_rank is not None:
            cmd += ["--enable-lora", "--max-lora-rank", str(self.max_lora_rank)]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        return ServerSpec((*cmd, *self.extra_args, *flags), env)


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


def server_env(
    env: Mapping[str, str] | None,
    api_key: str | None,
    *,
    weight_dir: str | Path | None = None,
    weight_sync_hosts: Sequence[str] = (),
) -> dict[str, str]:
    """``env`` (default: this process's) with the project on ``PYTHONPATH`` and what ties a
    server to its run: :data:`API_KEY_ENV` when ``api_key`` is set, :data:`WEIGHT_DIR_ENV`
    when ``weight_dir`` is, :data:`WEIGHT_SYNC_HOSTS_ENV` when ``weight_sync_hosts`` is not
    empty (each left as ``env`` has it otherwise).

    The secret travels in the environment, never on the command line: ``/proc/PID/environ``
    is readable by the server's owner alone, ``/proc/PID/cmdline`` by every user.
    """
    child = dict(os.environ if env is None else env)
    # The server imports ``engines`` and ``trainer`` from this checkout even when not installed.
    paths = [str(_PROJECT_ROOT), *filter(None, child.get("PYTHONPATH", "").split(os.pathsep))]
    child["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if api_key is not None:
        child[API_KEY_ENV] = api_key
    if weight_dir is not None:
        child[WEIGHT_DIR_ENV] = os.path.abspath(weight_dir)
    if weight_sync_hosts:
        child[WEIGHT_SYNC_HOSTS_ENV] = ",".join(weight_sync_hosts)
    return child


def popen_kwargs(spec: ServerSpec, log_file: IO[bytes], env: Mapping[str, str]) -> dict[str, Any]:
    """How both launchers start ``spec``: its own session (so its process group is its own),
    a pipe on its stdin (it exits when the launcher dies), stdout and stderr to ``log_file``,
    ``env`` plus the spec's own variables."""
    return {
        "stdin": subprocess.PIPE,
        "stdout": log_file,
        "stderr": subprocess.STDOUT,
        "start_new_session": True,
        "env": {**env, **spec.env},
    }


def base_url(host: str, port: int) -> str:
    """``http://HOST:PORT`` (an IPv6 host in brackets)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
