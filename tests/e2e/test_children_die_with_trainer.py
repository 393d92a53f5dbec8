"""``python -m trainer`` sent SIGTERM or SIGKILL while its engine servers start leaves no
process of the run 10 s later: servers started afresh (``PR_SET_PDEATHSIG``, set before the
server runs a line of its own) and servers forked from a fork server (killed by it when the
trainer's connection closes).

The fresh servers are held before their first line by a ``sitecustomize`` on their
``PYTHONPATH`` (where the old launchers relied on a stdin the server had not begun to watch):
each writes its pid to a folder and sleeps, which is the event the test waits for. Forked
servers do not run it (they start imported); the test waits until both exist.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from engines.launch import ForkedPopen, fork_popen
from tests.e2e.helpers import (
    REPO,
    fork_server,
    new_marker,
    processes_with_marker,
    trainer_env,
    wait_until_gone,
)

#: Holds a fresh ``python -m engines.local`` before its first line while the folder is named.
SITECUSTOMIZE = """
import os, sys, time
folder = os.environ.get("TRAINER_TEST_HOLD_DIR")
if folder and "engines.local" in sys.orig_argv:
    open(os.path.join(folder, str(os.getpid())), "w").close()
    time.sleep(600)
"""
#: The issue's bound: nothing of the run after 10 s.
GONE_S = 10.0
#: Generous: a loaded machine may take long to get a run to start its servers.
START_S = 180.0


def _start_trainer(
    marker: str, run_dir: Path, env_extra: dict[str, str], *, forked_engines: bool
) -> ForkedPopen:
    """The run, forked from the suite's fork server; its servers forked from it too or not."""
    argv = [sys.executable, "-m", "trainer", "trainer.progress=false", "engine.num_engines=2"]
    argv += ["trainer.max_steps=1", f"trainer.run_dir={run_dir}"]
    env = {**trainer_env(marker), **env_extra}
    socket_path = fork_server()
    if forked_engines:
        env["TRAINER_FORK_SERVER"] = socket_path
    else:
        env.pop("TRAINER_FORK_SERVER", None)
    with open(os.devnull, "rb") as null, open(os.devnull, "wb") as out:
        return fork_popen(
            socket_path,
            argv,
            env=env,
            cwd=REPO,
            stdin=null.fileno(),
            stdout=out.fileno(),
            stderr=out.fileno(),
        )


def _wait_for(what: str, ready: Callable[[], bool], run: ForkedPopen) -> None:
    deadline = time.monotonic() + START_S
    while not ready():
        assert run.poll() is None, f"the run ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {START_S:g}s"
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("sig", "forked_engines"),
    [(signal.SIGTERM, False), (signal.SIGKILL, False), (signal.SIGKILL, True)],
    ids=["sigterm", "sigkill", "sigkill-fork-server"],
)
def test_a_trainer_killed_while_its_engines_start_leaves_no_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sig: signal.Signals, forked_engines: bool
) -> None:
    marker = new_marker()
    hold, site = tmp_path / "held", tmp_path / "site"
    hold.mkdir()
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    monkeypatch.setenv("PYTHONPATH", path)  # trainer_env puts the checkout first
    extra = {"TRAINER_TEST_HOLD_DIR": str(hold)}
    run = _start_trainer(marker, tmp_path / "run", extra, forked_engines=forked_engines)
    try:
        if forked_engines:
            _wait_for(
                "two servers",
                lambda: len(set(processes_with_marker(marker)) - {run.pid}) >= 2,
                run,
            )
        else:
            _wait_for("two held servers", lambda: len(list(hold.iterdir())) >= 2, run)
        run.send_signal(sig)
        run.wait(60)
        assert wait_until_gone(marker, GONE_S) == []
    finally:
        for pid in processes_with_marker(marker):  # what a failure left (the old launchers')
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if run.poll() is None:
            run.kill()
