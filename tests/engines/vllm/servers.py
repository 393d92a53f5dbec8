"""A real vLLM server on the CPU, from ``.venv-vllm``: started as docs/vllm.md tells a user to
start one (:func:`launch`), waited for until it answers ``/health``, stopped with its whole
process group. The tier (:mod:`tests.engines.vllm.tier`) decides which ones run and when."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import attrs
import httpx

from engines.process_group import free_port
from engines.vllm.auth import MIDDLEWARE
from engines.vllm.serve import TOKEN_IN_FLAG, cpu_env

__all__ = ["PROJECT", "START_TIMEOUT_S", "VLLM_PYTHON", "Launched", "RealServer", "launch"]

PROJECT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = PROJECT / ".venv-vllm" / "bin" / "python"
#: How long a server may take to start (30-45 s on an idle two-core machine; more when busy).
START_TIMEOUT_S = 300.0


@attrs.frozen
class RealServer:
    """A running vLLM server (float32) and its weight-transfer backend."""

    url: str
    model_dir: Path
    log: Path
    pid: int
    backend: str
    #: The secret it asks for on every route but ``/health`` and ``/ping`` (``VLLM_API_KEY``
    #: and the trainer's ``--middleware``, as the trainer starts its own); None: vLLM's default,
    #: no key at all.
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header it asks for (none without a key)."""
        return {} if self.api_key is None else {"Authorization": f"Bearer {self.api_key}"}


@attrs.define(eq=False)
class Launched:
    """A vLLM server process started (see :func:`launch`): a thread waits for its ``/health``
    (:data:`START_TIMEOUT_S` at most) and notes how long that took."""

    server: RealServer
    proc: subprocess.Popen[bytes]
    #: ``time.monotonic()`` at its start.
    started: float
    #: Set once it answers ``/health`` or has failed to (``error``).
    ready: threading.Event = attrs.Factory(threading.Event)
    #: Seconds it took to answer ``/health``; None until it has.
    start_s: float | None = None
    error: str | None = None

    def __attrs_post_init__(self) -> None:
        threading.Thread(target=self._watch, name="vllm-start", daemon=True).start()

    def wait_healthy(self) -> RealServer:
        """The server, once it answers ``/health`` (``RuntimeError`` if it exited first or took
        longer than :data:`START_TIMEOUT_S`)."""
        self.ready.wait()
        if self.error is not None:
            raise RuntimeError(self.error)
        return self.server

    def stop(self) -> None:
        _stop(self.proc)
        self.ready.wait()

    def _watch(self) -> None:
        try:
            _wait_healthy(self.server.url, self.proc, self.server.log, self.started)
            self.start_s = time.monotonic() - self.started
        except RuntimeError as e:
            self.error = str(e)
        finally:
            self.ready.set()


def launch(
    log_dir: Path,
    backend: str,
    model_dir: Path,
    *,
    lora_rank: int | None = None,
    api_key: str | None = None,
    weight_dir: Path | None = None,
) -> Launched:
    """A real vLLM server with this weight-transfer backend (the project's plugin's ``gloo`` or
    ``disk``) serving ``model_dir``, started as docs/vllm.md tells a user to start one, under
    the project's stdin guard (a killed pytest takes it down); :meth:`Launched.stop` stops
    its whole process group. ``lora_rank``: serving LoRA adapters up to that rank, with their
    load and unload routes (``--enable-lora``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
    ``api_key``: asked for on every route but the health probes, as the trainer's own servers
    (``VLLM_API_KEY`` in its environment, :mod:`engines.vllm.auth` as ``--middleware``).
    ``weight_dir``: the folder its ``disk`` updates may read (``TRAINER_WEIGHT_DIR``; none:
    the plugin refuses every disk update)."""
    port = free_port()
    log = log_dir / "server.log"
    cmd = [str(VLLM_PYTHON), "-m", "engines.launch.stdin_guard", "--grace-s", "10", "--"]
    cmd += [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--seed", "0", "--max-model-len", "256", "--enforce-eager"]
    cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    cmd += [TOKEN_IN_FLAG]  # the token-in route, as the trainer's own servers get it
    # a line per request handed to the engine core ("Added request ..."): what a test waits
    # for while vLLM is paused, when its gauges (updated on scheduler steps) count nothing
    cmd += ["--enable-log-requests"]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **cpu_env()}
    if lora_rank is not None:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank), "--max-loras", "1"]
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if weight_dir is not None:
        env["TRAINER_WEIGHT_DIR"] = str(weight_dir)
    if api_key is not None:
        cmd += ["--middleware", MIDDLEWARE]
        env["VLLM_API_KEY"] = api_key
    env["PYTHONPATH"] = str(PROJECT)
    started = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=PROJECT,
            start_new_session=True,
        )
    server = RealServer(f"http://127.0.0.1:{port}", model_dir, log, proc.pid, backend, api_key)
    return Launched(server, proc, started)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path, started: float) -> None:
    deadline = started + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited ({proc.returncode}): {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"vLLM not healthy after {START_TIMEOUT_S}s: {log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    """End-of-file to the guard (it stops the group), then SIGKILL to the group if needed."""
    assert proc.stdin is not None
    proc.stdin.close()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything of the group the guard left
    except ProcessLookupError:
        pass
