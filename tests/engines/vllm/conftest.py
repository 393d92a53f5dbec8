"""The real-vLLM tier: real vLLM servers on the CPU, from ``.venv-vllm``, shared by the whole
tier, and trainer runs that start their own vLLM.

- **Shared servers** (:data:`SHARED`): one per model and weight-transfer backend for the whole
  tier (``vllm_server``, ``vllm_disk_server``, ``smollm2_server``, ...), each stopped after
  the last selected test that uses it. They start in the background, in the order the tests
  first need them, one at a time, at most :data:`PRESTART` ahead: a start costs 30-90 s of
  CPU, and the tests leave one of two cores idle most of the time. ``fresh_vllm_disk_server`` is one
  test's own (``test_differential.py``: it compares vLLM as started, and ends it); that
  test runs last (:data:`LAST`), its server started in the background meanwhile.
- **Trainer runs** (marker ``trainer_run``, ``test_vllm_backend.py``): the ``python -m
  trainer`` run a test checks, started in the background at the tier's start, one after
  another in the tests' order; the test waits for its run and asserts on it.

Skipped, with one line saying how to get it, where ``.venv-vllm`` is missing (``bash setup.sh
--vllm``); run it alone with ``pytest -m vllm``. The tests themselves may run in either
environment: the server runs in ``.venv-vllm``'s Python, the trainer's side (client, policy,
gloo group) in the test's own. At the end the tier prints its budget: the servers it started,
their start-up seconds (and how many of them its tests waited for), and its tests' seconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx
import pytest

from engines.models import build_tiny_model, resolve_model_path
from engines.process_group import free_port
from engines.vllm.serve import TOKEN_IN_FLAG, cpu_env
from tests.e2e.helpers import new_marker, trainer_env

PROJECT = Path(__file__).resolve().parents[3]
VLLM_PYTHON = PROJECT / ".venv-vllm" / "bin" / "python"
#: How long a server may take to start (30-45 s on an idle two-core machine; more when busy).
START_TIMEOUT_S = 300.0
#: Servers started ahead of the test that first needs them (memory: 1-3 GB each), one at a
#: time.
PRESTART = 3
#: How long one background trainer run may take (the 200-step run: 2-3 minutes).
RUN_TIMEOUT_S = 900.0

#: The tier's servers: key -> (weight-transfer backend, model directory's maker, which gets a
#: directory of its own to write in).
SHARED: dict[str, tuple[str, Callable[[Path], Path]]] = {
    "tiny-gloo": ("gloo", lambda _: build_tiny_model()),
    "tiny-disk": ("disk", lambda _: build_tiny_model()),
    "tiny-disk-fresh": ("disk", lambda _: build_tiny_model()),
    "tiny-tied-gloo": ("gloo", lambda _: build_tiny_model(tied=True)),
    "smollm2-gloo": ("gloo", lambda _: resolve_model_path("smollm2-135m-instruct")),
    "smollm2-disk": ("disk", lambda _: resolve_model_path("smollm2-135m-instruct")),
    "trained-policy": ("disk", lambda base: trained_policy(base)),
}
#: Test files run last in the tier: ``test_differential.py`` has a server of its own
#: (``tiny-disk-fresh``), which it ends; first in the tier, every test waited for its start.
LAST = frozenset({"test_differential.py"})
#: The fixtures that hand out a server: fixture -> its key (``{param}``: the fixture's
#: parameter), so that collection knows the order the servers are needed in and each one's
#: last test.
FIXTURE_KEYS = {
    "vllm_server": "tiny-gloo",
    "vllm_server_as_left": "tiny-gloo",
    "vllm_disk_server": "tiny-disk",
    "fresh_vllm_disk_server": "tiny-disk-fresh",
    "tied_server": "tiny-tied-gloo",
    "smollm2_server": "smollm2-{param}",
    "trained_policy_server": "trained-policy",
}


@attrs.frozen
class RealServer:
    """A running vLLM server (float32) and its weight-transfer backend."""

    url: str
    model_dir: Path
    log: Path
    pid: int
    backend: str


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


def launch(log_dir: Path, backend: str, model_dir: Path) -> Launched:
    """A real vLLM server with this weight-transfer backend (the project's plugin's ``gloo`` or
    ``disk``) serving ``model_dir``, started as docs/vllm.md tells a user to start one, under
    the project's stdin guard (a killed pytest takes it down); :meth:`Launched.stop` stops
    its whole process group."""
    port = free_port()
    log = log_dir / "server.log"
    cmd = [str(VLLM_PYTHON), "-m", "engines.launch.stdin_guard", "--grace-s", "10", "--"]
    cmd += [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--dtype", "float32", "--seed", "0", "--max-model-len", "256", "--enforce-eager"]
    cmd += ["--weight-transfer-config", json.dumps({"backend": backend})]
    cmd += [TOKEN_IN_FLAG]  # the token-in route, as the trainer's own servers get it
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **cpu_env()}
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
    server = RealServer(f"http://127.0.0.1:{port}", model_dir, log, proc.pid, backend)
    return Launched(server, proc, started)


@attrs.define(eq=False)
class TrainerRun:
    """One test's ``python -m trainer`` in ``.venv-vllm`` (marker ``trainer_run``), run in
    the background; :meth:`result` waits for it."""

    #: Its overrides, ``trainer.run_dir`` last.
    overrides: tuple[str, ...]
    run_dir: Path
    #: In the environment of every process of the run (``tests.e2e.helpers``).
    marker: str = attrs.Factory(new_marker)
    done: threading.Event = attrs.Factory(threading.Event)
    proc: subprocess.CompletedProcess[str] | None = None

    def run(self, popens: list[subprocess.Popen[str]]) -> None:
        cmd = [str(VLLM_PYTHON), "-m", "trainer", *self.overrides]
        out, err = self.run_dir.parent / "stdout.log", self.run_dir.parent / "stderr.log"
        try:
            with open(out, "w") as stdout, open(err, "w") as stderr:
                proc = subprocess.Popen(
                    cmd,
                    env=trainer_env(self.marker),  # every process of the run carries the marker
                    cwd=PROJECT,
                    stdin=subprocess.DEVNULL,
                    stdout=stdout,
                    stderr=stderr,
                    text=True,
                )
                popens.append(proc)
                try:
                    code = proc.wait(timeout=RUN_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    code = proc.wait()
            self.proc = subprocess.CompletedProcess(cmd, code, out.read_text(), err.read_text())
        finally:
            self.done.set()

    def result(self) -> subprocess.CompletedProcess[str]:
        """The finished run (its output), once it has exited."""
        self.done.wait()
        assert self.proc is not None, "the tier stopped before this run ended"
        return self.proc


@attrs.define(eq=False)
class Tier:
    """The tier's servers, its background trainer runs, and its budget."""

    #: The shared servers in the order the selected tests first need them.
    order: list[str]
    #: The last selected test (node id) of each server: it is stopped after it.
    last_user: dict[str, str]
    #: The selected tests' trainer runs, by node id, in the tests' order.
    runs: dict[str, TrainerRun]
    base: Path | None = None
    #: Servers started (perhaps not healthy yet), by key.
    launched: dict[str, Launched] = attrs.Factory(dict)
    #: Keys a test was handed (prestarting counts the others), and those stopped.
    handed: set[str] = attrs.Factory(set)
    stopped: set[str] = attrs.Factory(set)
    #: Shared servers that a test may have left broken on purpose (``vllm_server_as_left``).
    may_be_broken: set[str] = attrs.Factory(set)
    #: Every server started, for the budget.
    every: list[Launched] = attrs.Factory(list)
    #: Seconds tests waited for a server to start.
    waited_s: float = 0.0
    #: Seconds of the tier's tests (setup, call and teardown), added up as they end.
    tests_s: float = 0.0
    runner: threading.Thread | None = None
    popens: list[subprocess.Popen[str]] = attrs.Factory(list)
    closing: bool = False

    def start(self, base: Path) -> None:
        """Start what the tier runs in the background (once): the first servers the tests need
        and the trainer runs, one after another."""
        if self.base is not None:
            return
        self.base = base
        self._prestart()
        if self.runs:
            self.runner = threading.Thread(target=self._run_all, name="tier-runs", daemon=True)
            self.runner.start()

    def shared(self, key: str, *, as_left: bool = False) -> RealServer:
        """The server ``key`` (of :data:`SHARED`), started if it is not.

        ``as_left``: for a test that may leave it broken on purpose (paused, an update open) and
        for one that mends what the test before left; otherwise a server such a test left
        paused is replaced by a fresh one first (only where ``-k`` ran the breaking test without
        the ones that mend it). No test may end a shared server (``tiny-disk-fresh`` is one
        test's own).
        """
        left = self.launched.get(key)
        if left and key in self.may_be_broken and not as_left and _paused(left.server):
            self.stop(key)
            self.stopped.discard(key)
        if as_left:
            self.may_be_broken.add(key)
        else:
            self.may_be_broken.discard(key)
        if key not in self.launched:
            self._launch(key)
        self.handed.add(key)
        launched = self.launched[key]
        before = time.monotonic()
        server = launched.wait_healthy()
        self.waited_s += time.monotonic() - before
        self._prestart()
        return server

    def stop(self, key: str) -> None:
        """Stop the server ``key``, if it runs."""
        if key in self.launched:
            self.launched.pop(key).stop()
            self.stopped.add(key)

    def after(self, nodeid: str) -> None:
        """Stop each server whose last selected test is ``nodeid``; start the next ones."""
        for key, last in self.last_user.items():
            if last == nodeid:
                self.stop(key)
        self._prestart()

    def close(self) -> None:
        """Stop every server and the trainer run in progress."""
        self.closing = True
        for proc in self.popens:
            if proc.poll() is None:
                proc.kill()
        if self.runner is not None:
            self.runner.join(timeout=60)
        for key in list(self.launched):
            self.stop(key)

    def budget(self) -> str:
        start_s = [launched.start_s for launched in self.every if launched.start_s is not None]
        return (
            f"vLLM tier: {len(self.every)} servers started by its fixtures, {sum(start_s):.0f} s "
            f"starting them ({self.waited_s:.0f} s of it waited for by tests), "
            f"{len(self.runs)} trainer runs, {self.tests_s:.0f} s in all its tests"
        )

    def _launch(self, key: str) -> None:
        assert self.base is not None, "Tier.start comes first"
        backend, model = SHARED[key]
        log_dir = self.base / f"{key}-{len(self.every)}"
        log_dir.mkdir(parents=True)
        self.launched[key] = launch(log_dir, backend, model(log_dir))
        self.every.append(self.launched[key])

    def _prestart(self) -> None:
        if self.base is None or self.closing:
            return
        if any(not launched.ready.is_set() for launched in self.launched.values()):
            return  # one start at a time
        if sum(key not in self.handed for key in self.launched) >= PRESTART:
            return
        for key in self.order:
            if key not in self.launched and key not in self.handed and key not in self.stopped:
                self._launch(key)
                return

    def _run_all(self) -> None:
        for run in self.runs.values():
            if self.closing:
                run.done.set()
            else:
                run.run(self.popens)


TIER = pytest.StashKey[Tier]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "trainer_run(*overrides): the test's `python -m trainer` run in .venv-vllm, started in "
        "the background by the real-vLLM tier (`{param}`: the test's parameter); fixture "
        "`trainer_run`",
    )


def pytest_collection_modifyitems(config, items):
    """The tests of :data:`LAST` run after the rest of the tier, so that their own server
    starts in the background while the others run instead of before the first test. Without
    ``.venv-vllm`` every test of the tier (marker ``vllm``) is skipped, saying how to get it."""
    items.sort(key=lambda item: item.path.name in LAST)  # stable: the order otherwise kept
    if VLLM_PYTHON.exists():
        return
    skip = pytest.mark.skip(reason="needs real vLLM: run `bash setup.sh --vllm`")
    for item in items:
        if item.get_closest_marker("vllm") is not None:
            item.add_marker(skip)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    """The tier's plan, from the selected tests in their order: which servers, in which order,
    the last test of each, and the trainer runs."""
    order: list[str] = []
    last_user: dict[str, str] = {}
    runs: dict[str, TrainerRun] = {}
    for item in session.items:
        if item.get_closest_marker("vllm") is None or _skipped(item):
            continue
        params = getattr(item, "callspec", None)
        params = params.params if params is not None else {}
        for name in item.fixturenames:
            if name in FIXTURE_KEYS:
                key = FIXTURE_KEYS[name].format(param=params.get(name))
                order += [key] if key not in order else []
                last_user[key] = item.nodeid
        marker = item.get_closest_marker("trainer_run")
        if marker is not None:
            overrides = tuple(arg.format(**params) for arg in marker.args)
            runs[item.nodeid] = TrainerRun(overrides, Path())
    session.config.stash[TIER] = Tier(order, last_user, runs)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test of the tier adds its seconds to the budget; after it, the servers it was the
    last test of are stopped and the next ones started."""
    started = time.monotonic()
    try:
        return (yield)
    finally:
        tier = item.config.stash.get(TIER, None)
        if tier is not None and item.get_closest_marker("vllm") is not None:
            tier.after(item.nodeid)
            tier.tests_s += time.monotonic() - started


def pytest_sessionfinish(session):
    tier = session.config.stash.get(TIER, None)
    if tier is not None:
        tier.close()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tier = config.stash.get(TIER, None)
    if tier is not None and tier.tests_s > 0:
        terminalreporter.write_line(tier.budget())


@pytest.fixture(scope="session", autouse=True)
def tier(request, tmp_path_factory) -> Tier:
    """The tier (its background work started on the first test here)."""
    tier = request.config.stash[TIER]
    if tier.order or tier.runs:
        base = tmp_path_factory.mktemp("vllm-tier")
        for nodeid, run in tier.runs.items():
            name = nodeid.rsplit("::", 1)[-1].replace("/", "-")[:60]
            run.run_dir = base / "runs" / name / "run"
            run.run_dir.parent.mkdir(parents=True)
            run.overrides = (*run.overrides, f"trainer.run_dir={run.run_dir}")
        tier.start(base)
    return tier


@pytest.fixture
def vllm_server(tier) -> RealServer:
    """The tier's ``gloo`` server of the built-in tiny model, in a good state."""
    return tier.shared("tiny-gloo")


@pytest.fixture
def vllm_server_as_left(tier) -> RealServer:
    """The same server as the test before left it: for a test that may leave it broken on
    purpose, and for one that mends what such a test left (``test_real_vllm.py``'s broken
    transfers, in the file's order)."""
    return tier.shared("tiny-gloo", as_left=True)


@pytest.fixture
def vllm_disk_server(tier) -> RealServer:
    """The tier's ``disk`` server of the built-in tiny model."""
    return tier.shared("tiny-disk")


@pytest.fixture
def fresh_vllm_disk_server(tier) -> RealServer:
    """A ``disk`` server of the built-in tiny model that no other test uses: for one that
    needs it as started and ends it."""
    return tier.shared("tiny-disk-fresh")


@pytest.fixture
def trained_policy_server(tier) -> RealServer:
    """A ``disk`` server of a trained checkpoint's ``policy/`` directory, as it is."""
    return tier.shared("trained-policy")


@pytest.fixture(params=["gloo", "disk"])
def smollm2_server(tier, request) -> RealServer:
    """The tier's server of SmolLM2-135M-Instruct, one per weight-transfer backend."""
    return tier.shared(f"smollm2-{request.param}")


@pytest.fixture
def trainer_run(tier, request) -> TrainerRun:
    """The test's trainer run (marker ``trainer_run``), started in the background."""
    return tier.runs[request.node.nodeid]


def trained_policy(base: Path) -> Path:
    """The ``policy/`` of a one-step run's checkpoint (built-in tiny model, in-process
    engine), trained in ``base``: what a user would serve as the run's result."""
    run_dir = base / "run"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            "engine.backend=inprocess",
            "trainer.max_steps=1",
            "trainer.ckpt_interval=1",
            "trainer.train_batch_size=2",
            "generator.n_samples_per_prompt=2",
            "trainer.progress=false",
            f"trainer.run_dir={run_dir}",
        ],
        cwd=PROJECT,
        check=True,
        capture_output=True,
        timeout=RUN_TIMEOUT_S,
    )
    return run_dir / "checkpoints" / "global_step_1" / "policy"


def _skipped(item: pytest.Item) -> bool:
    """Whether a ``skip`` mark, or a ``skipif`` with a true (not string) condition, skips it."""
    if item.get_closest_marker("skip") is not None:
        return True
    return any(
        mark.args and not isinstance(mark.args[0], str) and bool(mark.args[0])
        for mark in item.iter_markers("skipif")
    )


def _paused(server: RealServer) -> bool:
    return httpx.get(f"{server.url}/is_paused", timeout=60).json()["is_paused"] is True


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
