"""``engines.vllm.auth``, the middleware the trainer gives every ``vllm serve``, over real HTTP
in front of a small app (the real-vLLM tier checks it inside vLLM:
``tests/engines/vllm/test_real_vllm_disk.py``)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from engines.local.http import answer_lifespan
from engines.vllm.auth import BearerAuthMiddleware
from tests.engines.helpers import serve_asgi

KEY = "k3y-of-this-run"


async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """An app that answers 200 with the path it was asked for."""
    if scope["type"] == "lifespan":
        await answer_lifespan(receive, send)
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": scope["path"].encode()})


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/update_weights"),
        ("POST", "/pause"),
        ("POST", "/collective_rpc"),
        ("GET", "/server_info"),
        ("POST", "/v1/completions"),
        ("GET", "/metrics"),
        ("GET", "/"),
        ("GET", "/healthz"),
    ],
)
async def test_every_route_but_the_probes_needs_the_runs_key(monkeypatch, method, path):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    async with serve_asgi(BearerAuthMiddleware(echo)) as url, httpx.AsyncClient() as http:
        for auth in (None, "Bearer wrong", f"bearer {KEY}", KEY, f"Bearer {KEY}x"):
            headers = {} if auth is None else {"Authorization": auth}
            refused = await http.request(method, url + path, headers=headers)
            assert refused.status_code == 401, auth
            assert refused.json() == {"error": "Unauthorized"}  # vLLM's own words
        answer = await http.request(method, url + path, headers={"Authorization": f"Bearer {KEY}"})
        assert (answer.status_code, answer.text) == (200, path)


async def test_the_health_probes_answer_without_the_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", KEY)
    async with serve_asgi(BearerAuthMiddleware(echo)) as url, httpx.AsyncClient() as http:
        assert (await http.get(f"{url}/health")).status_code == 200
        assert (await http.get(f"{url}/ping")).status_code == 200
        assert (await http.post(f"{url}/ping")).status_code == 200


def test_a_server_without_a_key_refuses_to_start(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(RuntimeError, match="needs VLLM_API_KEY"):
        BearerAuthMiddleware(echo)
