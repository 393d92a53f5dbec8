"""A run's engines answer only the run: the reference servers the trainer starts ask for its
secret on every route but ``/health``; a key given by the environment (``engine.api_key``'s
``TRAINER_ENGINE_API_KEY``) reaches the servers and the client, and lands in no file of the run
folder, and a resume gets it again from the environment."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import httpx
import pytest

from engines.local.server import ROUTES
from engines.local.weight_routes import WEIGHT_TRANSFER_PATHS
from tests.e2e.helpers import new_marker, popen_trainer, read_metrics, run_trainer, wait_until_gone

pytestmark = pytest.mark.slow

SMALL = ("trainer.train_batch_size=4", "generator.n_samples_per_prompt=4")


def every_route() -> list[tuple[str, str]]:
    """(method, path) of every route the reference server serves, but ``GET /health``."""
    routes = [(method, path) for path, methods in ROUTES.items() for method in methods]
    routes += [("POST", path) for path in WEIGHT_TRANSFER_PATHS]
    return sorted({r for r in routes if r != ("GET", "/health")}, key=lambda r: r[0] != "GET")


def files_holding(run_dir: Path, secret: str) -> list[Path]:
    """Every file under ``run_dir`` whose bytes contain ``secret``."""
    return [p for p in run_dir.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_trainer_started_engine_refuses_every_route_but_health_without_the_run_secret(
    tmp_path,
):
    marker = new_marker()
    proc = popen_trainer(
        "trainer.max_steps=200", *SMALL, f"trainer.run_dir={tmp_path}", marker=marker
    )
    try:
        deadline = time.monotonic() + 280
        while not ((tmp_path / "metrics.jsonl").exists() and read_metrics(tmp_path)):
            assert proc.poll() is None, "the run ended before its first step"
            assert time.monotonic() < deadline, "no first step in time"
            time.sleep(0.3)
        log = (tmp_path / "engines" / "engine-0.log").read_text()
        port = int(re.findall(r"ENGINE_READY port=(\d+)", log)[-1])
        url = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=url, timeout=60) as http:
            for method, path in every_route():
                for headers in ({}, {"Authorization": "Bearer not-the-secret"}):
                    answer = http.request(method, path, json={}, headers=headers)
                    assert answer.status_code == 401, (method, path, answer.text)
            assert http.get("/health").status_code == 200  # the probe needs no key
        assert proc.poll() is None  # nothing of the above disturbed the run
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=120)
    assert wait_until_gone(marker) == []


def test_a_key_from_the_environment_drives_the_run_and_lands_in_no_file(tmp_path):
    key = "env-key-" + new_marker()
    run_dir = tmp_path / "run"
    env = {"TRAINER_ENGINE_API_KEY": key}
    common = (*SMALL, "trainer.ckpt_interval=1", f"trainer.run_dir={run_dir}")
    first = run_trainer("trainer.max_steps=2", *common, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    assert key not in first.stdout + first.stderr
    assert files_holding(run_dir, key) == []
    config = (run_dir / "config.yaml").read_text()
    assert "api_key: null" in config
    # a resume from the recorded config gets the key from the environment again
    resumed = run_trainer(
        "--config",
        str(run_dir / "config.yaml"),
        "trainer.max_steps=3",
        "trainer.resume_mode=latest",
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run_dir)][-1] == 3
    assert files_holding(run_dir, key) == []
