"""What the real-vLLM tests check of every weight-transfer backend: a sync makes the engine
score exactly as the policy, and a run against the server trains with exact weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.e2e.helpers import run_trainer
from tests.engines.vllm.servers import PROJECT, RealServer
from tests.sync.exactness import VERSIONS, syncs_make_the_engine_score_as_the_policy


async def assert_syncs_make_the_engine_score_as_the_policy(
    server: RealServer, transport: Any, tolerance: float = 1e-4
) -> None:
    """:func:`~tests.sync.exactness.syncs_make_the_engine_score_as_the_policy` on ``server``;
    then vLLM labels its weights with the last sync's version (``/finish_weight_update``'s
    ``weight_version``), as ``GET /weight_info`` says."""
    await syncs_make_the_engine_score_as_the_policy(
        server.url, server.model_dir, transport, tolerance, api_key=server.api_key
    )
    async with httpx.AsyncClient(timeout=60, headers=server.headers) as http:
        label = (await http.get(f"{server.url}/weight_info")).json()
    assert label == {"weight_version": str(VERSIONS[-1])}


def assert_exact_steps(run_dir: Path, steps: int) -> list[dict[str, Any]]:
    """The run's ``steps`` metrics lines, each with every importance ratio within 1e-3 of 1
    (the engine sampled with exactly the policy's weights)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        assert abs(row["policy/is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["policy/is_ratio_max"] - 1) < 1e-3, row
    return rows


def remote_command(server: RealServer, run_dir: Path, steps: int, *overrides: str) -> list[str]:
    """``python -m trainer`` with ``engine.backend=remote`` against ``server`` (its backend as
    ``sync.transport``) for ``steps`` steps, in this Python."""
    cmd = [sys.executable, "-m", "trainer", "engine.backend=remote"]
    cmd += [f"sync.transport={server.backend}", f"engine.urls=[{server.url}]"]
    return [*cmd, f"trainer.max_steps={steps}", f"trainer.run_dir={run_dir}", *overrides]


#: The environment :func:`remote_command` runs in when started as a new process.
REMOTE_ENV = {**os.environ, "PYTHONPATH": str(PROJECT)}


def run_remote(
    server: RealServer, run_dir: Path, steps: int, *overrides: str
) -> subprocess.CompletedProcess[str]:
    """:func:`remote_command`'s run, to its end: forked from the test process's fork server
    (:func:`tests.e2e.helpers.run_trainer`), not a new Python; the server's key, where it
    asks for one, in ``TRAINER_ENGINE_API_KEY`` (never on the command line)."""
    args = remote_command(server, run_dir, steps, *overrides)[3:]  # after `python -m trainer`
    env = {} if server.api_key is None else {"TRAINER_ENGINE_API_KEY": server.api_key}
    return run_trainer(*args, timeout=600, env=env)


def assert_remote_run_is_exact(server: RealServer, tmp_path: Path) -> None:
    """3 exact steps of :func:`run_remote`."""
    proc = run_remote(server, tmp_path / "run", 3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_exact_steps(tmp_path / "run", 3)
