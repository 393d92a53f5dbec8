"""Fixtures: the tiny model, and a real engine server shared by a test module.

The server is the production launcher's (``launch_local_engines``) held open by
:class:`~tests.engines.helpers.BackgroundEngines`; tests talk to it over HTTP like the
trainer does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.launch import EngineUrls
from engines.models import build_tiny_model
from tests.engines.helpers import BackgroundEngines


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture(scope="module")
def engine_urls(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineUrls]:
    """One reference server for the whole module (its log under a temp dir), sleep mode on,
    disk updates from under the session's temporary folder;
    its secret is ``engine_urls.api_key`` (``tests.engines.helpers.auth`` makes the header)."""
    engines = BackgroundEngines(
        1,
        model_dir,
        tmp_path_factory.mktemp("engine-logs"),
        extra_args=("--enable-sleep-mode",),
        # the session's temporary folder: a test writes its weight buckets in its own tmp_path
        weight_dir=tmp_path_factory.getbasetemp(),
    ).start()
    try:
        yield engines.urls
    finally:
        engines.stop()
