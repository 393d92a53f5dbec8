"""The reference server the bracket tests share (one per module) and a client of it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import pytest

from engines.client import InferenceClient
from engines.launch import EngineUrls
from engines.models import build_tiny_model
from tests.engines.helpers import BackgroundEngines
from trainer.errors import InferenceServerError


@pytest.fixture(scope="module")
def server_urls(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineUrls]:
    """The server's URL and its secret; disk updates from under the session's temporary
    folder (a test writes its buckets in its own ``tmp_path``)."""
    engines = BackgroundEngines(  # the brackets sleep it: sleep mode on
        1,
        build_tiny_model(),
        tmp_path_factory.mktemp("engine-logs"),
        extra_args=("--enable-sleep-mode",),
        weight_dir=tmp_path_factory.getbasetemp(),
    ).start()
    try:
        yield engines.urls
    finally:
        engines.stop()


@pytest.fixture
async def client(server_urls: EngineUrls) -> AsyncIterator[InferenceClient]:
    async with InferenceClient(server_urls, api_key=server_urls.api_key) as client:
        yield client
        # whatever a test did (or failed to undo), the next one finds the server serving, and
        # no update left open (an abandoned transfer's: the server refuses a start then, as
        # vLLM does); an engine left with partial weights is made whole by the next sync
        with contextlib.suppress(InferenceServerError):
            await client.control("POST", "/finish_weight_update", json={})
        await client.resume()
        await client.wake_up()
