"""The official ``openai`` client against the reference server (a real process): chat
completions, streaming, stop strings and ``logprobs=N``, each answer checked against vLLM
0.33.0's own JSON schemas (``reference/vllm_openai_schemas.json``, written by
``reference/dump_vllm_openai_schemas.py``).

The client is the synchronous ``openai.OpenAI`` (the tests are plain functions; the
asynchronous client is exercised by the agent generator's tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from engines.launch import EngineUrls
from tests.engines.helpers import auth

SCHEMAS = json.loads(
    (Path(__file__).parents[1] / "vllm_recorded" / "vllm_openai_schemas.json").read_text()
)["schemas"]
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "max 7 5 ="}]


def conforms(name: str, payload: Any) -> None:
    """``payload`` validates against vLLM's schema ``name``."""
    jsonschema.validate(payload, SCHEMAS[name])


@pytest.fixture(scope="module")
def client(engine_urls: EngineUrls) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{engine_urls[0]}/v1", api_key=engine_urls.api_key, max_retries=0
    )


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def events(urls: EngineUrls, path: str, body: dict[str, Any]) -> list[str]:
    """The raw server-sent events of a streamed request to ``urls[0]`` (``data: ...``
    payloads, in order); asserts the framing: every event is ``data: <payload>\\n\\n``."""
    with httpx.Client(timeout=120, headers=auth(urls)) as http:
        response = http.post(urls[0] + path, json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/event-stream")
    raw = response.text
    assert raw.endswith("\n\n")
    frames = raw.split("\n\n")[:-1]
    assert all(f.startswith("data: ") for f in frames), raw[:500]
    return [f.removeprefix("data: ") for f in frames]


def test_chat_completion_returns_text_token_ids_and_top_logprobs(
    client: openai.OpenAI, model: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=MESSAGES,
        max_tokens=6,
        seed=3,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    conforms("ChatCompletionResponse", raw.http_response.json())
    answer = raw.parse()
    (choice,) = answer.choices
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    token_ids = choice.model_extra["token_ids"]  # type: ignore[index]
    prompt_ids = answer.model_extra["prompt_token_ids"]  # type: ignore[index]
    assert 1 <= len(token_ids) <= 6 and prompt_ids
    assert answer.usage is not None and answer.usage.prompt_tokens == len(prompt_ids)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == len(token_ids)
    for entry in choice.logprobs.content:
        alternatives = [t.logprob for t in entry.top_logprobs]
        assert len(alternatives) == 3
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry.logprob <= alternatives[0] + 1e-6  # nothing beats the best alternative


def test_skip_special_tokens_false_keeps_every_sampled_token_in_the_text(
    client: openai.OpenAI, model: str
) -> None:
    def ask(skip: bool) -> tuple[list[str], list[int]]:
        answer = client.chat.completions.create(
            model=model,
            messages=MESSAGES,
            max_tokens=20,
            seed=5,
            extra_body={"return_token_ids": True, "ignore_eos": True, "skip_special_tokens": skip},
        )
        (choice,) = answer.choices
        return (choice.message.content or "").split(), choice.model_extra["token_ids"]  # type: ignore[index]

    kept, ids = ask(False)
    skipped, same_ids = ask(True)
    assert same_ids == ids
    assert len(kept) == len(ids)  # one word per token: nothing vanished
    assert [w for w in kept if w not in ("<pad>", "<eos>", "<bos>", "<unk>")] == skipped


def test_chat_stream_sends_vllms_events_and_adds_up_to_the_whole_answer(
    client: openai.OpenAI, model: str, engine_urls: EngineUrls
) -> None:
    request = {"model": model, "messages": MESSAGES, "max_tokens": 8, "seed": 11}
    whole = client.chat.completions.create(
        **request, extra_body={"return_token_ids": True, "ignore_eos": True}
    )
    chunks = list(
        client.chat.completions.create(
            **request,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_token_ids": True, "ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ids = [
        t
        for c in chunks
        if c.choices
        for t in (c.choices[0].model_extra or {}).get("token_ids") or []
    ]
    assert text == whole.choices[0].message.content
    assert ids == whole.choices[0].model_extra["token_ids"]  # type: ignore[index]
    finished = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finished == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 8

    payloads = events(
        engine_urls, "/v1/chat/completions", request | {"stream": True, "logprobs": True}
    )
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        conforms("ChatCompletionStreamResponse", json.loads(payload))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_string_cuts_the_text_and_ends_the_completion(
    client: openai.OpenAI, model: str, stream: bool
) -> None:
    base = {"model": model, "prompt": "max 7 5 =", "max_tokens": 12, "seed": 5}
    free = client.completions.create(
        **base, extra_body={"ignore_eos": True, "return_token_ids": True}
    )
    words = free.choices[0].text.split()
    assert len(words) >= 3
    stop = words[2]  # a word the seeded completion is known to produce
    cut = free.choices[0].text[: free.choices[0].text.find(stop)]
    extra = {"ignore_eos": True, "return_token_ids": True}
    if stream:
        chunks = list(client.completions.create(**base, stop=[stop], stream=True, extra_body=extra))
        text = "".join(c.choices[0].text for c in chunks)
        ids = [t for c in chunks for t in (c.choices[0].model_extra or {})["token_ids"]]
        last = chunks[-1].choices[0]
    else:
        answer = client.completions.create(**base, stop=[stop], extra_body=extra)
        last = answer.choices[0]
        text, ids = last.text, (last.model_extra or {})["token_ids"]
    assert text == cut
    assert last.finish_reason == "stop"
    assert (last.model_extra or {})["stop_reason"] == stop
    # the tokens up to the one that completed the stop string, no further
    free_ids = free.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert ids == free_ids[: len(ids)] and len(ids) < len(free_ids)


def test_chat_stop_string_and_completion_stream_validate(
    client: openai.OpenAI, model: str, engine_urls: EngineUrls
) -> None:
    free = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        seed=2,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    content = free.choices[0].message.content or ""
    stop = content.split()[1]
    stopped = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        max_tokens=10,
        seed=2,
        stop=stop,
        extra_body={"ignore_eos": True},  # type: ignore[arg-type]
    )
    assert stopped.choices[0].message.content == content[: content.find(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    payloads = events(
        engine_urls,
        "/v1/completions",
        {
            "model": model,
            "prompt": ["max 1 2 =", "max 3 4 ="],
            "n": 2,
            "max_tokens": 4,
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        },
    )
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    for chunk in chunks:
        conforms("CompletionStreamResponse", chunk)
    assert {c["choices"][0]["index"] for c in chunks if c["choices"]} == {0, 1, 2, 3}
    assert chunks[-1]["usage"]["completion_tokens"] == sum(
        len(c["choices"][0]["token_ids"]) for c in chunks if c["choices"]
    )


def test_completion_logprobs_n_reports_the_sampled_token_and_n_alternatives(
    client: openai.OpenAI, model: str
) -> None:
    base = {"model": model, "prompt": "max 3 8 =", "max_tokens": 5, "seed": 9}
    plain = client.completions.create(**base, logprobs=0)
    raw = client.completions.with_raw_response.create(**base, logprobs=4)
    conforms("CompletionResponse", raw.http_response.json())
    rich = raw.parse().choices[0].logprobs
    assert rich is not None and plain.choices[0].logprobs is not None
    # the same seeded tokens and logprobs: alternatives do not change what is sampled
    assert rich.tokens == plain.choices[0].logprobs.tokens
    assert rich.token_logprobs == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert rich.top_logprobs is not None
    for token, lp, top in zip(rich.tokens or [], rich.token_logprobs or [], rich.top_logprobs):
        assert top[token] == pytest.approx(lp)
        assert 4 <= len(top) <= 5  # the four best, plus the sampled token when not among them
        assert max(top.values()) >= lp


def test_schemas_file_names_the_vllm_it_was_dumped_from() -> None:
    data = json.loads(
        (Path(__file__).parents[1] / "vllm_recorded" / "vllm_openai_schemas.json").read_text()
    )
    assert data["vllm_version"] == "0.33.0"
    assert set(SCHEMAS) >= {
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "ChatCompletionStreamResponse",
        "CompletionStreamResponse",
    }


def test_completion_prompt_logprobs_answer_in_vllms_shape(
    engine_urls: EngineUrls, model: str
) -> None:
    url = engine_urls[0]
    body = {"model": model, "prompt": [5, 17, 3, 22, 9], "max_tokens": 1, "n": 2}
    with httpx.Client(timeout=120, headers=auth(engine_urls)) as http:
        answer = http.post(url + "/v1/completions", json={**body, "prompt_logprobs": 2}).json()
        conforms("CompletionResponse", answer)
        streamed = http.post(
            url + "/v1/completions", json={**body, "prompt_logprobs": 1, "stream": True}
        )
        too_many = http.post(url + "/v1/completions", json={**body, "prompt_logprobs": 21})
        chat = http.post(
            url + "/v1/chat/completions",
            json={"model": model, "messages": MESSAGES, "prompt_logprobs": 1},
        )
    first, second = (c["prompt_logprobs"] for c in answer["choices"])
    assert first == second  # every sample of a prompt carries its prompt's
    assert first[0] is None and len(first) == 5
    for tok, position in zip([17, 3, 22, 9], first[1:]):
        keys = list(position)
        assert keys[0] == str(tok)  # the prompt token first, then the best two
        # ranks 1 and 2, and the prompt token's own when it is not among them
        assert sorted(v["rank"] for v in position.values())[:2] == [1, 2]
        assert len(position) == (2 if position[str(tok)]["rank"] <= 2 else 3)
        assert all(isinstance(v["decoded_token"], str) for v in position.values())
        assert position[str(tok)]["logprob"] <= max(v["logprob"] for v in position.values())
    assert streamed.status_code == 400 and "stream=True" in streamed.text
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"
    assert chat.status_code == 400 and "prompt_logprobs" in chat.text
