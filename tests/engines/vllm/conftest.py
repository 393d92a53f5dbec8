"""The real-vLLM tier: one real vLLM server on the CPU per module, from ``.venv-vllm``.

Skipped, with one line saying how to get it, where ``.venv-vllm`` is missing (``bash setup.sh
--vllm``); run it alone with ``pytest -m vllm``. The tests themselves may run in either
environment: the server runs in ``.venv-vllm``'s Python, the trainer's side (client, policy,
gloo group) in the test's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from engines.models import build_tiny_model
from engines.process_group import free_port
from engines.vllm.serve import cpu_env

PROJECT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = PROJECT / ".venv-vllm" / "bin" / "python"
#: How long a server may take to start (30-45 s on an idle two-core machine; more when busy).
START_TIMEOUT_S = 300.0


def pytest_collection_modifyitems(config, items):
    """Without ``.venv-vllm`` every test of the tier (marker ``vllm``) is skipped, saying how
    to get it."""
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason="needs real vLLM: run `bash setup.sh --vllm`")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@attrs.frozen
class RealServer:
    """A running vLLM server (the tiny model, float32) and its weight-transfer backend."""

    url: str
    model_dir: Path
    log: Path
    pid: int
    backend: str


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory) -> Iterator[RealServer]:
    """One real vLLM server for the module, weight-transfer backend ``gloo``."""
    yield from serve(tmp_path_factory, "gloo")


def serve(tmp_path_factory, backend: str, model_dir: Path | None = None) -> Iterator[RealServer]:
    """A real vLLM server with this weight-transfer backend (the project's plugin's ``gloo`` or
    ``disk``), started as docs/vllm.md tells a user to start one, under the project's stdin
    guard (a killed pytest takes it down); stopped, its whole process group, at the end. It
    serves ``model_dir`` (default: the built-in tiny model)."""
    model_dir = model_dir or build_tiny_model()
    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    cmd = [str(VLLM_PYTHON), "-m", "engines.launch.stdin_guard", "--grace-s", "10", "--"]
    cmd += [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--seed", "0", "--max-model-len", "256", "--enforce-eager"]
    cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **cpu_env()}
    env["PYTHONPATH"] = str(PROJECT)
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
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc, log)
        yield RealServer(url, model_dir, log, proc.pid, backend)
    finally:
        _stop(proc)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
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
