"""The reference server over real HTTP, in a real process started by ``engines.launch``: what
it answers, batching, seeds and ``n``, and the 4xx every bad request gets.

One server serves the whole module (``engine_urls``); tests leave it resumed and awake with
the weights it started with, so they pass in any order. Tests that need a server in a state of
its own are elsewhere: pausing requests in flight (``test_server_in_flight.py``), sleep mode
and the weight-transfer routes switched off (``test_server_options.py``).
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import httpx
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.client import InferenceClient
from engines.launch import EngineUrls
from engines.models import load_tokenizer
from engines.types import Completion, SamplingParams
from tests.engines.helpers import auth, client_routes, stats, steps
from trainer.errors import FaultInjected
from trainer.vocabulary import install_faults, step_deadline


@pytest.fixture(autouse=True)
async def _leave_the_server_serving(engine_urls: EngineUrls) -> AsyncIterator[None]:
    """Whatever a test did (or failed to undo), the next one finds the server resumed and awake."""
    yield
    async with httpx.AsyncClient(timeout=30, headers=auth(engine_urls)) as http:
        await http.post(f"{engine_urls[0]}/resume")
        await http.post(f"{engine_urls[0]}/wake_up")


async def test_32_concurrent_requests_complete_and_are_batched(engine_urls: EngineUrls) -> None:
    url = engine_urls[0]
    before = (await stats(url, engine_urls.api_key))["batch_size_counts"]
    results: list[Completion | None] = [None] * 32
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:

        async def one(i: int) -> None:
            params = SamplingParams(max_tokens=24, ignore_eos=True, seed=i)
            results[i] = await client.generate([5 + i % 10, 6, 7], params, trajectory_id=f"t{i}")

        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(one, i)
    for c in results:
        assert c is not None
        assert c.finish_reason == "length"
        assert len(c.token_ids) == len(c.logprobs) == 24
        assert all(lp <= 0 for lp in c.logprobs)
    after = (await stats(url, engine_urls.api_key))["batch_size_counts"]
    new_steps = {int(k): v - before.get(k, 0) for k, v in after.items() if v > before.get(k, 0)}
    assert max(new_steps) > 1, f"no batching: {new_steps}"


async def test_completion_response_follows_vllm_shape(engine_urls: EngineUrls, model_dir) -> None:
    body = {
        "prompt": "1 + 2 =",
        "n": 2,
        "seed": 7,
        "max_tokens": 5,
        "ignore_eos": True,
        "logprobs": 0,
        "return_token_ids": True,
    }
    async with httpx.AsyncClient(headers=auth(engine_urls)) as http:
        data = (await http.post(f"{engine_urls[0]}/v1/completions", json=body)).json()
    assert data["object"] == "text_completion"
    prompt_ids = load_tokenizer(model_dir).encode("1 + 2 =")
    assert [c["index"] for c in data["choices"]] == [0, 1]
    for choice in data["choices"]:
        assert choice["prompt_token_ids"] == prompt_ids
        assert len(choice["token_ids"]) == 5
        assert len(choice["logprobs"]["token_logprobs"]) == 5
        assert len(choice["logprobs"]["tokens"]) == 5
        assert choice["finish_reason"] == "length"
    assert data["usage"] == {
        "prompt_tokens": 2 * len(prompt_ids),
        "completion_tokens": 10,
        "total_tokens": 2 * len(prompt_ids) + 10,
    }


async def test_same_seed_gives_the_same_tokens(engine_urls: EngineUrls) -> None:
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:
        params = SamplingParams(max_tokens=12, ignore_eos=True, seed=1234)
        a = await client.generate([3, 4, 5], params)
        b = await client.generate([3, 4, 5], params)
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs)


async def test_n_samples_in_one_request_equal_n_requests_seeded_one_apart(
    engine_urls: EngineUrls,
) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True, seed=500)
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:
        before = steps(await stats(engine_urls[0], engine_urls.api_key))
        together = await client.generate_n([3, 4, 5], params, 4)
        shared_steps = steps(await stats(engine_urls[0], engine_urls.api_key)) - before
        apart = [
            await client.generate([3, 4, 5], attrs.evolve(params, seed=500 + i)) for i in range(4)
        ]
    assert [c.token_ids for c in together] == [c.token_ids for c in apart]
    for a, b in zip(together, apart):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert a.prompt_token_ids == [3, 4, 5]
    assert len({tuple(c.token_ids) for c in together}) > 1  # four different samples
    assert shared_steps == 6  # the four decoded together: one step per token


async def test_the_client_reads_prompt_logprobs_back_as_the_model_scores_them(
    engine_urls: EngineUrls, model_dir
) -> None:
    """``SamplingParams.prompt_logprobs`` over HTTP: each prompt token's logprob, rank and the
    k best, as a forward of the prompt scores them (vLLM's shape read back by the client)."""
    import torch
    from transformers import AutoModelForCausalLM

    prompt, k = [5, 17, 3, 22, 9], 2
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:
        (scored,) = await client.generate_n(
            prompt, SamplingParams(max_tokens=1, prompt_logprobs=k), 1
        )
        plain = await client.generate(prompt, SamplingParams(max_tokens=1))
    assert plain.prompt_logprobs == []  # not asked for: none
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        rows = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert len(scored.prompt_logprobs) == len(prompt) and scored.prompt_logprobs[0] is None
    for row, tok, score in zip(rows, prompt[1:], scored.prompt_logprobs[1:]):
        assert score is not None
        assert score.logprob == pytest.approx(float(row[tok]), abs=1e-5)
        assert score.rank == int((row >= row[tok]).sum())
        values, ids = torch.topk(row, k)
        assert [t for t, _ in score.top] == ids.tolist()
        assert [lp for _, lp in score.top] == pytest.approx(values.tolist(), abs=1e-5)


async def test_a_generate_fault_fires_in_the_client_before_the_request(
    engine_urls: EngineUrls,
) -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=3)
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:
        assert len((await client.generate([3, 4, 5], params)).token_ids) == 4  # no fault: works
        before = steps(await stats(engine_urls[0], engine_urls.api_key))
        install_faults("generate:error=boom")
        try:
            with pytest.raises(FaultInjected) as info, step_deadline(5, None):
                await client.generate([3, 4, 5], params)
        finally:
            install_faults("")
        # nothing reached the server
        assert steps(await stats(engine_urls[0], engine_urls.api_key)) == before
        assert len((await client.generate([3, 4, 5], params)).token_ids) == 4
    assert (info.value.operation, info.value.message, info.value.step) == ("generate", "boom", 5)


async def test_info_routes(engine_urls: EngineUrls) -> None:
    url = engine_urls[0]
    async with httpx.AsyncClient(headers=auth(engine_urls)) as http:
        assert (await http.get(f"{url}/health")).status_code == 200
        models = (await http.get(f"{url}/v1/models")).json()
        assert models["object"] == "list" and models["data"][0]["object"] == "model"
        metrics = (await http.get(f"{url}/metrics")).text
        assert "engine_decode_steps_total" in metrics
    async with InferenceClient(engine_urls, api_key=engine_urls.api_key) as client:
        assert await client.get_world_size() == [1]
        await client.reset_prefix_cache()
        await client.probe([*client_routes()])


BAD_REQUESTS = [
    pytest.param("POST", "/v1/completions", b"{bad", id="malformed-json"),
    pytest.param("POST", "/v1/completions", b"[1, 2]", id="not-an-object"),
    pytest.param("POST", "/v1/completions", b'{"prompt": [1], "temperature": NaN}', id="nan"),
    pytest.param("POST", "/v1/completions", {"max_tokens": 4}, id="no-prompt"),
    pytest.param("POST", "/v1/completions", {"prompt": 5}, id="prompt-wrong-type"),
    pytest.param("POST", "/v1/completions", {"prompt": [1, "a"]}, id="token-wrong-type"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1], "max_tokens": "8"}, id="max-tokens-string"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "ignore_eos": 1}, id="bool-wrong-type"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1, 2], "max_tokens": -1}, id="negative-max-tokens"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1, 10**6]}, id="out-of-vocab"),
    pytest.param("POST", "/v1/completions", {"prompt": [-1]}, id="negative-token-id"),
    pytest.param(
        "POST", "/v1/completions", {"prompt": [1] * 250, "max_tokens": 100}, id="too-long"
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "top_p": 0}, id="top-p-zero"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "echo": True}, id="echo-unsupported"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "logprobs": 21}, id="logprobs-over-20"),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "stop": [3]}, id="stop-not-strings"),
    pytest.param("POST", "/v1/chat/completions", {"max_tokens": 4}, id="chat-no-messages"),
    pytest.param(
        "POST", "/v1/chat/completions", {"messages": [{"content": "a"}]}, id="chat-no-role"
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        id="chat-image-part",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2},
        id="chat-top-logprobs-without-logprobs",
    ),
    pytest.param(
        "POST",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "a"}],
            "tools": [{"type": "function", "function": {"name": "f"}}],
        },
        id="chat-auto-tool-choice",
    ),
    pytest.param("POST", "/v1/completions", {"prompt": [1], "model": "nope"}, id="unknown-model"),
    pytest.param("POST", "/pause?mode=later", None, id="unknown-pause-mode"),
    pytest.param("POST", "/sleep?level=3", None, id="unknown-sleep-level"),
    pytest.param("POST", "/wake_up?tags=gpu", None, id="unknown-wake-tag"),
    pytest.param("POST", "/weight_checker", {"action": "explode"}, id="unknown-weight-action"),
    pytest.param("GET", "/v1/completions", None, id="wrong-method"),
    pytest.param("GET", "/no/such/route", None, id="unknown-route"),
]


@pytest.mark.parametrize(("method", "path", "body"), BAD_REQUESTS)
async def test_each_bad_input_class_gets_a_4xx_with_an_error_body(
    engine_urls: EngineUrls, method: str, path: str, body: Any
) -> None:
    content = (
        body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    )
    async with httpx.AsyncClient(headers=auth(engine_urls)) as http:
        response = await http.request(method, engine_urls[0] + path, content=content)
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == response.status_code


JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(-3, 100), max_size=4),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
REQUEST = st.fixed_dictionaries(
    {},
    optional={
        "prompt": st.one_of(JUNK, st.lists(st.integers(-3, 70), max_size=6), st.text(max_size=12)),
        "max_tokens": st.one_of(JUNK, st.integers(-3, 6)),
        "n": st.one_of(JUNK, st.integers(-2, 3)),
        "temperature": JUNK,
        "top_p": JUNK,
        "seed": JUNK,
        "stop_token_ids": JUNK,
        "ignore_eos": JUNK,
        "logprobs": st.one_of(JUNK, st.integers(-1, 2)),
        "return_token_ids": JUNK,
        "model": JUNK,
        "stream": JUNK,
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.one_of(REQUEST, st.binary(max_size=20)))
async def test_no_request_body_yields_a_5xx(engine_urls: EngineUrls, body: Any) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(timeout=60, headers=auth(engine_urls)) as http:
        response = await http.post(f"{engine_urls[0]}/v1/completions", content=content)
    assert response.status_code < 500, response.text
    if response.status_code >= 400:
        assert response.json()["error"]["code"] == response.status_code
