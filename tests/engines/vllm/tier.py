"""The real-vLLM tier's plan: its shared servers, started ahead of the tests that need them
(:class:`Tier`), and the trainer runs it runs in the background (:class:`TrainerRun`). The
pytest hooks and fixtures that drive it are in the tier's ``conftest.py``."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import httpx

from engines.launch import new_api_key
from engines.models import build_tiny_model, resolve_model_path
from tests.e2e.helpers import new_marker, trainer_env
from tests.engines.vllm.servers import PROJECT, VLLM_PYTHON, Launched, RealServer, launch

__all__ = ["PRESTART", "RUN_TIMEOUT_S", "SHARED", "Tier", "TrainerRun", "trained_policy"]

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
    "tiny-lora": ("disk", lambda _: build_tiny_model()),
}
#: The servers that serve LoRA adapters, up to this rank.
LORA_RANKS = {"tiny-lora": 8}
#: The servers that ask for a secret (a fresh one) on every route but the health probes, as
#: the trainer's own ``vllm serve`` do: their tests send it (``RealServer.api_key``).
KEYED = frozenset({"tiny-disk"})


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
        self.launched[key] = launch(
            log_dir,
            backend,
            model(log_dir),
            lora_rank=LORA_RANKS.get(key),
            api_key=new_api_key() if key in KEYED else None,
            # the session's temporary folder: each test writes its buckets in its own tmp_path
            weight_dir=self.base.parent if backend == "disk" else None,
        )
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


def _paused(server: RealServer) -> bool:
    return httpx.get(f"{server.url}/is_paused", timeout=60).json()["is_paused"] is True
