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

    def sdk(self, scenario: str, key: str = KEY, timeout_s: float = 300) -> dict:
        """``sdk_client.py SCENARIO`` in .venv-tinker against this service: its JSON."""
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
            "TINKER_API_KEY": key,
            "SDK_CLIENT_TORCH_SITE": str(Path(torch_site()).resolve()),
        }
        done = subprocess.run(
            [str(SDK_PYTHON), str(CLIENT), self.url, scenario],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    env = os.environ | {"TRAINER_SERVE_API_KEY": KEY, "PYTHONPATH": str(ROOT)}
    log = tmp_path_factory.mktemp("serve") / "serve.log"  # a file: a pipe nobody reads fills
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "trainer", "serve", "serve.port=0"],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = None
    deadline = time.monotonic() + START_TIMEOUT_S
    while url is None and time.monotonic() < deadline and process.poll() is None:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("TRAINER_SERVE_READY "):
                url = line.split("url=", 1)[1].strip()
        time.sleep(0.2)  # polling a file for a line, not waiting on a race
    if url is None:
        process.kill()
        process.wait()
        pytest.fail("the service printed no ready line:\n" + log.read_text()[-3000:])
    try:
        yield Service(url, process)
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
