"""The reference server the bracket tests share (one per module) and a client of it."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from engines.client import InferenceClient
from engines.models import build_tiny_model
from tests.engines.helpers import BackgroundEngines


@pytest.fixture(scope="module")
def server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    engines = BackgroundEngines(
        1, build_tiny_model(), tmp_path_factory.mktemp("engine-logs")
    ).start()
    try:
        yield engines.urls[0]
    finally:
        engines.stop()


@pytest.fixture
async def client(server_url: str) -> AsyncIterator[InferenceClient]:
    async with InferenceClient([server_url]) as client:
        yield client
        # whatever a test did (or failed to undo), the next one finds the server serving
        await client.resume()
        await client.wake_up()
