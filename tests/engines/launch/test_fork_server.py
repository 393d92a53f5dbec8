"""engines.launch.fork_server: a forked child is a fresh ``python -m`` in all a launcher relies
on (argv, environment, working directory, descriptors, its own session, its exit status), the
server refuses what it cannot run, and the launchers' servers forked from it serve, restart
and never outlive their owner."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engines.client import InferenceClient
from engines.launch import (
    FORK_SERVER_READY,
    ForkedProcess,
    ReferenceServers,
    fork_popen,
    fork_process,
    forkable,
    list_children,
    open_engine_processes,
)
from engines.types import SamplingParams
from tests.e2e.helpers import REPO, alive_after, fork_server, pid_alive
from trainer.config import load_config
from trainer.errors import ConfigError, ForkServerError

#: A child that reports what a fresh interpreter would see.
PROBE = """
import json, os, sys
print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mark": os.environ.get("MARK"),
                  "pgid": os.getpgid(0), "pid": os.getpid(), "name": __name__}))
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def probe_module(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A module ``probe_<x>`` in ``tmp_path`` (the children's working directory)."""
    name = f"probe_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(PROBE)
    yield name, tmp_path


@pytest.fixture
def bare_server() -> Iterator[tuple[subprocess.Popen[str], str]]:
    """A fork server of its own, nothing preloaded."""
    path = os.path.join(tempfile.mkdtemp(prefix="fs-test-"), "fork.sock")
    proc = subprocess.Popen(
        [sys.executable, "-m", "engines.launch.fork_server", "--socket", path],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().startswith(FORK_SERVER_READY)
    yield proc, path
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()


def _fork(path: str, argv: list[str], cwd: Path, env: dict[str, str], out: Path, err: Path):
    with open(out, "wb") as o, open(err, "wb") as e, open(os.devnull, "rb") as null:
        return fork_popen(
            path, argv, env=env, cwd=cwd, stdin=null.fileno(), stdout=o.fileno(), stderr=e.fileno()
        )


def test_a_child_sees_its_argv_env_cwd_descriptors_and_own_session(bare_server, probe_module):
    import json

    _, path = bare_server
    name, cwd = probe_module
    env = {**os.environ, "MARK": "m1"}
    child = _fork(path, [sys.executable, "-m", name, "3", "x"], cwd, env, cwd / "o", cwd / "e")
    assert [(pid, mark) for pid, mark in list_children(path, "MARK")] in ([(child.pid, "m1")], [])
    assert child.wait(60) == 3  # its own exit status
    seen = json.loads((cwd / "o").read_text())
    assert seen == {
        "argv": ["3", "x"],
        "cwd": str(cwd),
        "mark": "m1",
        "pgid": child.pid,  # a session (and process group) of its own
        "pid": child.pid,
        "name": "__main__",
    }
    assert (cwd / "e").read_text() == "to stderr\n"
    assert list_children(path, "MARK") == []  # reaped


def test_a_killed_child_reports_the_signal_as_subprocess_does(bare_server, probe_module):
    _, path = bare_server
    _, cwd = probe_module
    (cwd / "sleeper.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    child = _fork(
        path, [sys.executable, "-m", "sleeper"], cwd, dict(os.environ), cwd / "o", cwd / "e"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(0.2)
    child.kill()
    assert child.wait(60) == -signal.SIGKILL


def test_what_it_cannot_run_or_reach_is_a_fork_server_error(bare_server, tmp_path):
    _, path = bare_server
    assert not forkable(["/usr/bin/python3", "-m", "x"]) or sys.executable == "/usr/bin/python3"
    with pytest.raises(ValueError, match="only"):
        fork_popen(path, ["/bin/true"], env={}, cwd=tmp_path, stdin=0, stdout=1, stderr=2)
    with pytest.raises(ForkServerError, match="cannot be reached") as info:
        fork_popen(
            str(tmp_path / "none.sock"),
            [sys.executable, "-m", "x"],
            env={},
            cwd=tmp_path,
            stdin=0,
            stdout=1,
            stderr=2,
        )
    assert str(tmp_path / "none.sock") in str(info.value)


def test_it_exits_on_end_of_file_once_its_children_have(bare_server, probe_module):
    proc, path = bare_server
    _, cwd = probe_module
    (cwd / "waiter.py").write_text("import sys\nsys.stdin.read()\n")
    read, write = os.pipe()
    with open(cwd / "o", "wb") as o:
        child = fork_popen(
            path,
            [sys.executable, "-m", "waiter"],
            env=dict(os.environ),
            cwd=cwd,
            stdin=read,
            stdout=o.fileno(),
            stderr=o.fileno(),
        )
    os.close(read)
    assert proc.stdin is not None
    proc.stdin.close()  # its owner went away ...
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(1)  # ... but a child still runs: it waits for it (nothing new is forked)
    os.close(write)  # the child's own owner goes away: it exits, then the server
    assert child.wait(60) == 0
    assert proc.wait(60) == 0
    assert not os.path.exists(path)


#: A client that forks ``sleeper`` (which ignores its stdin and SIGTERM), prints its pid, waits.
CLIENT = """
import os, sys
from engines.launch import fork_popen
child = fork_popen(sys.argv[1], [sys.executable, "-m", "sleeper"], env=dict(os.environ),
                   cwd=sys.argv[2], stdin=0, stdout=2, stderr=2)
print(child.pid, flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_child_whose_client_dies_is_killed_at_once(bare_server, probe_module, sig) -> None:
    """Its stdin stays open (the fork server holds nothing of it; here the test's own pipe):
    only the client's death can end it, and does."""
    _, path = bare_server
    _, cwd = probe_module
    (cwd / "sleeper.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n"
    )
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, path, str(cwd)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert client.stdout is not None
        child = int(client.stdout.readline())
        assert pid_alive(child)
        client.send_signal(sig)
        client.wait(30)
        assert alive_after([child], 10.0) == []
    finally:
        client.kill()
        client.wait()
        for pipe in (client.stdin, client.stdout):
            if pipe is not None:
                pipe.close()


async def test_a_trio_child_gets_a_stdin_pipe_that_ends_it(bare_server, probe_module):
    _, path = bare_server
    _, cwd = probe_module
    (cwd / "reader.py").write_text("import sys\nprint(len(sys.stdin.read()))\n")
    out = await trio.to_thread.run_sync(open, cwd / "o", "wb")
    with out:
        child = await fork_process(
            path,
            [sys.executable, "-m", "reader"],
            env=dict(os.environ),
            cwd=cwd,
            stdout=out.fileno(),
            stderr=out.fileno(),
        )
    assert isinstance(child, ForkedProcess) and child.poll() is None
    await child.stdin.send_all(b"four")
    await child.stdin.aclose()
    with trio.fail_after(60):
        assert await child.wait() == 0
    assert (cwd / "o").read_text() == "4\n"


async def test_reference_servers_forked_from_it_serve_restart_and_leave_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    path = fork_server()  # the test process's, with the reference engine imported
    async with open_engine_processes(
        1, ReferenceServers(str(model_dir)), tmp_path, fork_server=path, startup_timeout_s=180
    ) as engines:
        first = engines[0]
        assert isinstance(first.process, ForkedProcess)
        assert first.pid in [pid for pid, _ in list_children(path, "PYTHONPATH")]
        async with InferenceClient([first.url], api_key=engines.api_key) as client:
            done = await client.generate([5, 6], SamplingParams(max_tokens=2, seed=0))
        assert len(done.token_ids) == 2
        second = await engines.restart(0)  # killed, forked again, healthy
        assert isinstance(second.process, ForkedProcess) and second.pid != first.pid
        assert not pid_alive(first.pid)
        async with InferenceClient([second.url], api_key=engines.api_key) as client:
            again = await client.generate([5, 6], SamplingParams(max_tokens=2, seed=0))
        assert again.token_ids == done.token_ids  # the same seed, the same engine
    assert await trio.to_thread.run_sync(alive_after, [second.pid]) == []


def test_engine_fork_server_must_name_a_socket_where_servers_are_started(tmp_path, monkeypatch):
    monkeypatch.delenv("TRAINER_FORK_SERVER", raising=False)
    with pytest.raises(ConfigError, match="is not a socket: start one with"):
        load_config(None, [f"engine.fork_server={tmp_path / 'none.sock'}"])
    # where no server is started, it is not used, so not checked
    load_config(None, [f"engine.fork_server={tmp_path / 'none.sock'}", "engine.backend=inprocess"])
    assert load_config(None, [f"engine.fork_server={fork_server()}"]).engine.fork_server


def test_a_preloaded_main_module_runs_afresh_without_runpys_warning(tmp_path):
    """``--preload engines.local.__main__`` (as docs/engines.md says) and then ``-m
    engines.local``: the module runs as ``__main__`` once more, quietly, as a new python."""
    path = os.path.join(tempfile.mkdtemp(prefix="fs-test-"), "fork.sock")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "engines.launch.fork_server",
            "--socket",
            path,
            "--preload",
            "trainer.__main__",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(FORK_SERVER_READY)
        argv = [sys.executable, "-m", "trainer", "ckpt", "list", str(tmp_path)]
        child = _fork(path, argv, REPO, dict(os.environ), tmp_path / "o", tmp_path / "e")
        code = child.wait(120)
    finally:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.close()
        proc.wait(30)
        proc.stdout.close()
    err = (tmp_path / "e").read_text()
    assert "RuntimeWarning" not in err and "found in sys.modules" not in err, err
    assert code == 0 and (tmp_path / "o").read_text() == f"no checkpoints under {tmp_path}\n"


def test_a_fork_server_that_never_answers_is_an_error_not_a_hang(tmp_path, monkeypatch):
    """A request is bounded (REQUEST_TIMEOUT_S): a server that takes it and never answers (a
    real listening socket nobody serves) is a ForkServerError saying so."""
    import socket

    from engines.launch import _fork_client

    monkeypatch.setattr(_fork_client, "REQUEST_TIMEOUT_S", 0.5)
    path = str(tmp_path / "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as mute:
        mute.bind(path)
        mute.listen(1)  # connections are queued and never read
        with pytest.raises(ForkServerError, match="did not answer"):
            list_children(path, "PYTHONPATH")
        with pytest.raises(ForkServerError, match="did not answer"):
            _fork(path, [sys.executable, "-m", "x"], tmp_path, {}, tmp_path / "o", tmp_path / "e")


@pytest.mark.skipif(os.getuid() != 0, reason="connecting as another user needs root")
def test_only_its_owner_may_have_it_fork(bare_server):
    """Its socket is made 0600; and a process of another user that connects all the same (a
    mode loosened, a folder anyone may enter) is turned away before it can ask for a fork: it
    would run code as the server's user."""
    _, path = bare_server
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    os.chmod(path, 0o666)
    os.chmod(os.path.dirname(path), 0o755)
    stranger = (
        "import os, sys\n"
        "from engines.launch import fork_popen\n"
        "os.setgid(65534); os.setuid(65534)\n"
        f"fork_popen({path!r}, [sys.executable, '-m', 'json.tool', '-h'], env={{}}, cwd='/',"
        " stdin=0, stdout=1, stderr=2)\n"
        "print('forked')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", stranger],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "forked" not in result.stdout
    assert "ForkServerError" in result.stderr, result.stderr[-2000:]
