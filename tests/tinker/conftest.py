"""The Tinker tier (marker ``tinker``): ``python -m trainer serve`` driven by the official SDK,
``tinker==0.38.0`` from ``.venv-tinker`` (``bash setup.sh --tinker``), in a subprocess: the
trainer's environment never imports the SDK, the SDK's never imports the trainer.

One service per test module (``service`` fixture), started as a real process on a free port.
Every test of the tier is skipped, saying how to get it, where ``.venv-tinker`` is missing.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

ROOT = Path(__file__).resolve().parents[2]
SDK_PYTHON = ROOT / ".venv-tinker" / "bin" / "python"
CLIENT = Path(__file__).with_name("sdk_client.py")
KEY = "tml-tier-test-key"
#: Seconds the service gets to print its ready line (imports torch and transformers).
START_TIMEOUT_S = 120.0


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.tinker)
            if not SDK_PYTHON.exists():
                item.add_marker(
                    pytest.mark.skip(reason=".venv-tinker is missing: bash setup.sh --tinker")
                )


def torch_site() -> str:
    """The trainer environment's site-packages, where torch is (.venv-tinker has none)."""
    import torch

    return str(Path(torch.__file__).resolve().parents[1])


@attrs.frozen
class Service:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def sdk(self, scenario: str, *args: str, key: str = KEY, timeout_s: float = 300) -> dict:
        """``sdk_client.py SCENARIO ARGS`` in .venv-tinker against this service: its JSON."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
            "TINKER_API_KEY": key,
            "SDK_CLIENT_TORCH_SITE": str(Path(torch_site()).resolve()),
        }
        done = subprocess.run(
            [str(SDK_PYTHON), str(CLIENT), self.url, scenario, *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@contextmanager
def open_service(
    workdir: Path,
    *overrides: str,
    python: Path = Path(sys.executable),
    start_timeout_s: float = START_TIMEOUT_S,
    env: dict[str, str] | None = None,
) -> Iterator[Service]:
    """``python -m trainer serve serve.port=0 OVERRIDES`` in ``python``, its checkpoints and log
    (``serve.log``) under ``workdir`` (``env`` on top of this process's), until the block exits
    (SIGTERM: it stops its engines)."""
    env = os.environ | (env or {}) | {"TRAINER_SERVE_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    log = workdir / "serve.log"  # a file: a pipe nobody reads fills
    args = ["serve.port=0", f"serve.checkpoint_dir={workdir / 'checkpoints'}", *overrides]
    with log.open("ab") as out:
        process = subprocess.Popen(
            [str(python), "-m", "trainer", "serve", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = None
    deadline = time.monotonic() + start_timeout_s
    while url is None and time.monotonic() < deadline and process.poll() is None:
        for line in log.read_text(errors="replace").splitlines()[::-1]:
            if line.startswith("TRAINER_SERVE_READY "):
                url = line.split("url=", 1)[1].strip()
                break
        time.sleep(0.2)  # polling a file for a line, not waiting on a race
    if url is None:
        process.kill()
        process.wait()
        pytest.fail("the service printed no ready line:\n" + log.read_text()[-3000:])
    try:
        yield Service(url, process, log)
    finally:
        stop(process)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30) -> float:
    """SIGTERM, then the seconds until it exited (SIGKILL past ``timeout_s``)."""
    if process.poll() is not None:
        return 0.0
    start = time.monotonic()
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return time.monotonic() - start


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    with open_service(tmp_path_factory.mktemp("serve")) as running:
        yield running
