"""The reference server's token-in route, ``POST /inference/v1/generate`` (a real process):
its answers validated against vLLM 0.32.0's own schemas (``reference/vllm_token_schemas.json``,
written by ``reference/dump_vllm_token_schemas.py``), its tokens and logprobs the same as the
OpenAI completions route's for the same prompt ids and seed, its refusals vLLM's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from engines.launch import EngineUrls
from tests.engines.helpers import auth

SCHEMAS = json.loads(
    (Path(__file__).parents[1] / "vllm_recorded" / "vllm_token_schemas.json").read_text()
)["schemas"]
PROMPT_IDS = [5, 17, 3, 22, 9]


#: The shared server's ``Authorization`` header (set by the ``url`` fixture).
HEADERS: dict[str, str] = {}


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=120, headers=HEADERS) as http:
        return http.post(url + path, json=body)


@pytest.fixture(scope="module")
def url(engine_urls: EngineUrls) -> str:
    HEADERS.update(auth(engine_urls))
    return engine_urls[0]


@pytest.fixture(scope="module")
def model(url: str) -> str:
    with httpx.Client(timeout=60, headers=HEADERS) as http:
        return http.get(url + "/v1/models").json()["data"][0]["id"]


def generate(url: str, model: str, **sampling: Any) -> dict[str, Any]:
    body = {"model": model, "token_ids": PROMPT_IDS, "sampling_params": sampling}
    jsonschema.validate(body, SCHEMAS["GenerateRequest"])
    r = post(url, "/inference/v1/generate", body)
    assert r.status_code == 200, r.text
    payload = r.json()
    jsonschema.validate(payload, SCHEMAS["GenerateTokensResponse"])
    return payload


def test_token_in_answers_the_completions_routes_tokens_and_logprobs_by_token_id(
    url: str, model: str
) -> None:
    sampling = {"temperature": 1.0, "max_tokens": 6, "seed": 11, "logprobs": 1}
    answer = generate(url, model, **sampling, skip_special_tokens=False)
    assert answer["output_mode"] == "tokens" and answer["model"] == model
    assert answer["request_id"].startswith("generate-tokens-")
    (choice,) = answer["choices"]
    r = post(url, "/v1/completions", {"model": model, "prompt": PROMPT_IDS, **sampling})
    want = r.json()["choices"][0]
    got_ids = choice["token_ids"]
    assert got_ids and len(got_ids) <= 6
    assert choice["finish_reason"] == want["finish_reason"]
    content = choice["logprobs"]["content"]
    assert [e["token_id"] for e in content] == got_ids
    assert [e["logprob"] for e in content] == pytest.approx(
        want["logprobs"]["token_logprobs"], abs=1e-5
    )
    # vLLM's tokens mode names each token by id only (no "token_id:N" string), the sampled
    # token first in top_logprobs, max(logprobs, 1) entries
    assert all("token" not in e for e in content)
    assert all([t["token_id"] for t in e["top_logprobs"]] == [e["token_id"]] for e in content)
    assert answer["usage"]["completion_tokens"] == len(got_ids)
    assert answer["usage"]["prompt_tokens"] == len(PROMPT_IDS)


def test_token_in_seeds_n_and_stop_token_ids_as_vllm(url: str, model: str) -> None:
    one = generate(url, model, temperature=1.0, max_tokens=8, seed=3)
    again = generate(url, model, temperature=1.0, max_tokens=8, seed=3)
    assert one["choices"][0]["token_ids"] == again["choices"][0]["token_ids"]
    assert one["choices"][0]["logprobs"] is None  # none asked for
    two = generate(url, model, temperature=1.0, max_tokens=8, seed=3, n=2)
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][0]["token_ids"] != two["choices"][1]["token_ids"]
    greedy = generate(url, model, temperature=0, max_tokens=6)["choices"][0]["token_ids"]
    stop = greedy[2]
    cut = generate(url, model, temperature=0, max_tokens=6, stop_token_ids=[stop])["choices"][0]
    assert cut["token_ids"] == greedy[: greedy.index(stop) + 1]
    assert (cut["finish_reason"], cut["stop_reason"]) == ("stop", stop)
    # max_tokens absent: what fits the context, as vLLM's get_max_tokens
    fits = generate(url, model, temperature=0, ignore_eos=True)["choices"][0]
    with httpx.Client(timeout=60, headers=HEADERS) as http:
        max_len = http.get(url + "/v1/models").json()["data"][0]["max_model_len"]
    assert len(fits["token_ids"]) == max_len - len(PROMPT_IDS)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "nope", "token_ids": [1], "sampling_params": {}}, 404, "model"),
        ({"sampling_params": {"max_tokens": 2}}, 400, "token_ids"),
        ({"token_ids": [], "sampling_params": {}}, 400, "token_ids"),
        ({"token_ids": [10**9], "sampling_params": {}}, 400, "token_ids"),
        ({"token_ids": [1]}, 400, "sampling_params"),
        ({"token_ids": [1], "sampling_params": {"max_tokens": 0}}, 400, "max_tokens"),
        ({"token_ids": [1], "sampling_params": {}, "stream": True}, 400, "stream"),
        ({"token_ids": [1], "sampling_params": {}, "output_mode": "text"}, 400, "output_mode"),
    ],
)
def test_token_in_refuses_bad_requests_with_vllms_error_body(
    url: str, body: dict[str, Any], status: int, param: str
) -> None:
    r = post(url, "/inference/v1/generate", body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert (error["code"], error["param"]) == (status, param)
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


def test_token_in_prompt_logprobs_equal_the_completions_routes(url: str, model: str) -> None:
    answer = generate(url, model, max_tokens=1, prompt_logprobs=2)
    with httpx.Client(timeout=120, headers=HEADERS) as http:
        completion = http.post(
            url + "/v1/completions",
            json={"model": model, "prompt": PROMPT_IDS, "max_tokens": 1, "prompt_logprobs": 2},
        ).json()
    scores = answer["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(PROMPT_IDS)
    assert scores == completion["choices"][0]["prompt_logprobs"]
