"""Running ``python -m trainer`` for real, and checking that nothing of it survives.

:func:`run_trainer` forks each run from this test process's fork server
(:mod:`engines.launch.fork_server`, started on first use with the trainer and the reference
engine imported), and the run's reference servers from it too (``TRAINER_FORK_SERVER``): a
run is a real process of its own, as from a shell, without paying about 5 s of imports for
itself and each of its servers. :func:`popen_trainer` starts a fresh ``python`` (the tests
that signal or stream a run).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from engines.launch import FORK_SERVER_READY, ForkedPopen, fork_popen, list_children

REPO = Path(__file__).resolve().parents[2]
MARKER_ENV = "TRAINER_TEST_MARKER"
#: What the fork server imports before it forks anything.
PRELOAD = ("trainer.run", "trainer.__main__", "engines.local.__main__")
_fork_server: tuple[subprocess.Popen[str], str] | None = None


def repo_pythonpath() -> str:
    """The checkout first, then the caller's own path (packages installed with ``--target``,
    as on a GPU image without a venv, stay importable)."""
    return os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def trainer_env(marker: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRAINER_FAULTS"}
    env[MARKER_ENV] = marker  # inherited by every process the run starts
    env["PYTHONPATH"] = repo_pythonpath()
    return env


def new_marker() -> str:
    return uuid.uuid4().hex


def fork_server() -> str:
    """The socket of this test process's fork server, started on first use and stopped at exit
    (it also exits when this process dies: its stdin is a pipe from here)."""
    global _fork_server
    if _fork_server is not None and _fork_server[0].poll() is None:
        return _fork_server[1]
    socket_path = os.path.join(tempfile.mkdtemp(prefix="trainer-fs-"), "fork.sock")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINER_")}
    env["PYTHONPATH"] = repo_pythonpath()
    cmd = [sys.executable, "-m", "engines.launch.fork_server", "--socket", socket_path]
    proc = subprocess.Popen(
        [*cmd, "--preload", ",".join(PRELOAD)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith(FORK_SERVER_READY), f"the fork server did not start: {line!r}"
    _fork_server = (proc, socket_path)
    atexit.register(_stop_fork_server, proc)
    return socket_path


def _stop_fork_server(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.close()  # it exits once its children have
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.stdout is not None:
        proc.stdout.close()


def run_trainer(
    *args: str,
    marker: str | None = None,
    timeout: float = 300,
    module: str = "trainer",
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``python -m trainer trainer.progress=false ARGS`` to its end: a fork of the fork server,
    its reference servers too; stdout and stderr captured. ``module``: another entry point
    that runs the trainer's ``main`` (a test fixture's, such as
    ``tests.e2e.transfer_on_event_loop``). ``env``: variables set on top of this process's
    environment for the run."""
    argv = [sys.executable, "-m", module, "trainer.progress=false", *args]
    extra = env or {}
    env = trainer_env(marker or new_marker())
    env.update(extra)
    env["TRAINER_FORK_SERVER"] = socket_path = fork_server()
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        open(os.devnull, "rb") as null,
    ):
        proc = fork_popen(
            socket_path,
            argv,
            env=env,
            cwd=REPO,
            stdin=null.fileno(),
            stdout=out.fileno(),
            stderr=err.fileno(),
        )
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
            raise
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return subprocess.CompletedProcess(argv, code, stdout, stderr)


class ForkedRun(ForkedPopen):
    """A run started by :func:`popen_trainer`: a ``subprocess.Popen`` as far as the tests use
    one, with its stdout and stderr (one text stream) in ``stdout``."""

    stdout: IO[str]

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        """The rest of its output once it has exited (``TimeoutExpired`` past ``timeout``)."""
        rest: list[str] = []
        reader = threading.Thread(target=lambda: rest.append(self.stdout.read()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
        self.stdout.close()
        self.wait(timeout)
        return rest[0], None


def popen_trainer(*args: str, marker: str) -> ForkedRun:
    """``python -m trainer trainer.progress=false ARGS``, started (forked as in
    :func:`run_trainer`) and left running: its output in ``stdout``."""
    argv = [sys.executable, "-m", "trainer", "trainer.progress=false", *args]
    env = trainer_env(marker)
    env["TRAINER_FORK_SERVER"] = socket_path = fork_server()
    read, write = os.pipe()
    try:
        with open(os.devnull, "rb") as null:
            run = fork_popen(
                socket_path,
                argv,
                env=env,
                cwd=REPO,
                stdin=null.fileno(),
                stdout=write,
                stderr=write,
                cls=ForkedRun,
            )
    except BaseException:
        os.close(read)
        raise
    finally:
        os.close(write)
    run.stdout = open(read, encoding="utf-8", errors="replace")  # noqa: SIM115
    return run


def processes_with_marker(marker: str) -> list[int]:
    """PIDs of live processes whose environment carries ``marker`` (the run and its children)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
            state = (proc / "stat").read_text().split()[2]
        except OSError:
            continue
        if f"{MARKER_ENV}={marker}".encode() in environ and state != "Z":
            found.append(int(proc.name))
    # a fork server's children show its environment in /proc: it says whose they are
    if _fork_server is not None and _fork_server[0].poll() is None:
        forked = list_children(_fork_server[1], MARKER_ENV)
        found += [pid for pid, value in forked if value == marker and pid_alive(pid)]
    return sorted(set(found))


def wait_until_gone(
    marker: str, timeout: float = 30.0, *, ignore: Callable[[int], bool] = lambda pid: False
) -> list[int]:
    """Processes with ``marker`` still alive after ``timeout`` seconds (servers of a SIGKILLed
    trainer exit when their stdin pipe closes; give them a bounded moment). Processes for
    which ``ignore(pid)`` holds are not waited for."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in processes_with_marker(marker) if not ignore(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.2)


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def alive_after(pids: list[int], timeout: float = 30.0) -> list[int]:
    """Of ``pids``, those still alive after waiting up to ``timeout`` seconds for them to exit."""
    deadline = time.monotonic() + timeout
    while (left := [p for p in pids if pid_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def last_stderr_line(proc: subprocess.CompletedProcess[str]) -> str:
    return proc.stderr.strip().splitlines()[-1]


def run_in_own_ray_cluster(script: str, *args: str, timeout_s: float) -> dict[str, Any]:
    """Run ``script`` (Python that starts a Ray cluster of its own and prints one line
    ``RESULT <json>``) in a child process; the decoded JSON. Fails with the child's stderr
    when it exits non-zero or prints no result."""
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env={**os.environ, "RAY_ADDRESS": ""},  # a cluster of its own, not the suite's
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


#: The kernel's hex of the addresses that are every interface (IPv4, IPv6).
ANY_ADDRESS = {"00000000", "00000000000000000000000000000000"}


def listeners_of(pids: list[int]) -> set[tuple[str, int]]:
    """(local address in the kernel's hex, port) of every TCP socket ``pids`` listen on."""
    inodes = set()
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue  # gone meanwhile
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        path = Path(table)
        for line in path.read_text().splitlines()[1:] if path.exists() else []:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: listening
                address, _, port = fields[1].rpartition(":")
                found.add((address, int(port, 16)))
    return found


@contextlib.contextmanager
def watch_listeners(marker: str) -> Iterator[set[tuple[str, int]]]:
    """Yields a set that collects, until the block ends, every listening socket of the
    processes carrying ``marker`` (looked at every 50 ms from a thread)."""
    seen: set[tuple[str, int]] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.05):
            seen.update(listeners_of(processes_with_marker(marker)))

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield seen
    finally:
        done.set()
        watcher.join(30)
