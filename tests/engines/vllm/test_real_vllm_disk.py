"""Against real vLLM on the CPU with the plugin's ``disk`` backend: the trainer's unchanged
``sync.transport=disk`` (safetensors buckets, vLLM's four-phase routes) makes it serve exactly
the policy's weights."""

from __future__ import annotations

import re

import httpx
import pytest

from engines.vllm.auth import HEALTH_PATHS
from sync.transports.disk import DiskTransport
from tests.engines.vllm.helpers import (
    assert_remote_run_is_exact,
    assert_syncs_make_the_engine_score_as_the_policy,
)

pytestmark = pytest.mark.vllm


async def test_a_disk_sync_makes_the_engine_score_as_the_policy(vllm_disk_server, tmp_path):
    """16 KiB buckets: one file, and one ``/update_weights``, per few tensors."""
    transport = DiskTransport(tmp_path / "weight_sync", 16 * 1024)
    await assert_syncs_make_the_engine_score_as_the_policy(vllm_disk_server, transport)


def test_engine_backend_remote_trains_3_steps_with_exact_weights_over_disk(
    vllm_disk_server, tmp_path
):
    assert_remote_run_is_exact(vllm_disk_server, tmp_path)


#: Routes FastAPI and vLLM serve besides those of the OpenAPI schema.
EXTRA_ROUTES = [("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/metrics")]


async def test_every_route_but_the_health_probes_needs_the_key(vllm_disk_server):
    """vLLM's own key covers /v1, /v2, /inference and /cohere; the trainer's middleware
    (engines.vllm.auth) covers the rest: the development routes (/pause, /collective_rpc,
    /update_weights ...) too. Every route the server lists answers 401 without the key, in
    vLLM's words; the probes answer without it; with it the routes answer as before."""
    server = vllm_disk_server
    assert server.api_key is not None
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        schema = (await http.get("/openapi.json", headers=server.headers)).json()
        routes = [
            (method.upper(), re.sub(r"\{[^}]+\}", "x", path))
            for path, methods in schema["paths"].items()
            for method in methods
            if path not in HEALTH_PATHS
        ]
        # vLLM's control plane, listed: what the key must cover beyond vLLM's own prefixes
        assert {("POST", "/pause"), ("POST", "/update_weights"), ("POST", "/sleep")} <= set(routes)
        assert len(routes) > 30
        # GETs first: a route left open by mistake is met where it changes nothing
        for method, path in sorted(routes + EXTRA_ROUTES, key=lambda r: r[0] != "GET"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "x"}):
                answer = await http.request(method, path, json={}, headers=headers)
                assert answer.status_code == 401, (method, path, answer.text)
                assert answer.json() == {"error": "Unauthorized"}
        for path in HEALTH_PATHS:
            assert (await http.get(path)).status_code == 200, path
        assert (await http.get("/is_paused", headers=server.headers)).json() == {"is_paused": False}
        models = await http.get("/v1/models", headers=server.headers)
        assert models.status_code == 200 and models.json()["data"]
