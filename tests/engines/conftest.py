"""Fixtures: the tiny model, and real engine servers shared by a test module.

pytest-trio runs each test in its own ``trio.run``, so a server shared across a module is
owned by a background thread running its own ``trio.run`` around ``launch_local_engines``
(the production launcher); tests talk to it over HTTP like the trainer does.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from engines.launch import launch_local_engines
from engines.models import build_tiny_model

#: Generous: two cores shared with other test runs.
STARTUP_TIMEOUT_S = 180.0


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return build_tiny_model()


class BackgroundEngines:
    """``launch_local_engines`` held open in a background thread until :meth:`stop`."""

    def __init__(self, num_engines: int, model_dir: Path, log_dir: Path) -> None:
        self.urls: list[str] = []
        self.log_dir = log_dir
        self.error: BaseException | None = None
        self._args = (num_engines, model_dir, log_dir)
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with launch_local_engines(
                *self._args, startup_timeout_s=STARTUP_TIMEOUT_S
            ) as urls:
                self.urls = urls
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> BackgroundEngines:
        self._thread.start()
        self._ready.wait(STARTUP_TIMEOUT_S + 30)
        if self.error is not None or not self.urls:
            raise RuntimeError(f"engine servers did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(60)


@pytest.fixture(scope="module")
def engine_urls(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    """One reference server for the whole module (its log under a temp dir)."""
    engines = BackgroundEngines(1, model_dir, tmp_path_factory.mktemp("engine-logs")).start()
    try:
        yield engines.urls
    finally:
        engines.stop()
