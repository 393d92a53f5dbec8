"""The capture proxy's token-in route (``.../inference/v1/generate``, what verifiers' training
client calls) in front of two real reference servers (in this process, over real HTTP): the
run's sampling set on each call, the answer adapted for renderers, each session on one engine.
Needs no verifiers."""

from __future__ import annotations

from typing import Any

import httpx

from engines.client import InferenceClient
from engines.models import build_tiny_model
from engines.types import SamplingParams
from tests.engines.helpers import serve_reference_engine
from trainer.generators.token_capture import open_capture_proxy


def steps(engine: Any) -> int:
    """Decode steps an engine has run so far."""
    return sum(engine.batch_size_counts.values())


async def post(base_url: str, body: dict[str, Any], session: str | None = None) -> httpx.Response:
    url = base_url.removesuffix("/v1") + "/inference/v1/generate"
    headers = {"X-Session-ID": session} if session else {}
    async with httpx.AsyncClient(timeout=120) as http:
        return await http.post(url, json=body, headers=headers)


async def test_token_in_calls_get_the_runs_sampling_renderers_tokens_and_one_engine_a_session():
    model_dir = build_tiny_model()
    sampling = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=3)
    async with (
        serve_reference_engine(model_dir) as (first_url, first),
        serve_reference_engine(model_dir) as (second_url, second),
        InferenceClient([first_url, second_url]) as engine,
        open_capture_proxy(engine, sampling) as proxy,
    ):
        base = proxy.register("run", 40)
        asked = {"temperature": 0.0, "max_tokens": 50, "logprobs": 1, "stop_token_ids": []}
        r = await post(base, {"model": "any", "token_ids": [5, 6, 7], "sampling_params": asked})
        assert r.status_code == 200, r.text
        (choice,) = r.json()["choices"]
        # the run's sampling: max_tokens capped at 3, temperature 1.0, seeded from 40
        assert len(choice["token_ids"]) <= 3
        # renderers' form added beside vLLM's own
        assert [e["token"] for e in choice["logprobs"]["content"]] == [
            f"token_id:{t}" for t in choice["token_ids"]
        ]
        assert all("token_id" in e for e in choice["logprobs"]["content"])
        (turn,) = proxy.turns("run")
        assert (turn.prompt_ids, turn.completion_ids) == ([5, 6, 7], choice["token_ids"])
        assert turn.logprobs == [e["logprob"] for e in choice["logprobs"]["content"]]
        # no logprobs asked: none in the answer, still recorded
        r = await post(base, {"token_ids": [5, 6], "sampling_params": {"max_tokens": 2}})
        assert r.json()["choices"][0]["logprobs"] is None
        assert len(proxy.turns("run")[-1].logprobs) == len(r.json()["choices"][0]["token_ids"])
        # every call of a session goes to that session's engine, and sessions spread
        sessions = ("episode-a", "episode-b", "episode-c", "episode-d")
        assert {engine.url_for(s) for s in sessions} == {first_url, second_url}
        for session in sessions:
            before = (steps(first), steps(second))
            for _ in range(2):
                r = await post(base, {"token_ids": [5], "sampling_params": {}}, session)
                assert r.status_code == 200
            after = (steps(first), steps(second))
            went = [a > b for a, b in zip(after, before)]
            assert went.count(True) == 1, (session, before, after)
            want = engine.url_for(session)
            assert went == [want == first_url, want == second_url]
        # a stream is refused by the proxy, before any engine sees it
        r = await post(base, {"token_ids": [5], "sampling_params": {}, "stream": True})
        assert r.status_code == 400
