"""The LoRA routes, live: the same script (:mod:`tests.engines.lora_script`) against real vLLM
(``--enable-lora --max-lora-rank 8``) and the reference server; each call's answer must be the
same (status, error type, message or success sentence), paths aside (vLLM hides some as
``<path>``) and vLLM's "Valid aliases" for an unknown model, and the completion through the reloaded
adapter must score what peft scores, on both."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.engines.local.test_lora_serving import lora_server
from tests.engines.lora_script import make_adapters, peft_logprobs, run_script

pytestmark = pytest.mark.vllm


def _paths_hidden(answer: tuple) -> tuple:
    """An error answer with every absolute path written ``<path>``: vLLM hides some paths in
    its messages (the served model's; an adapter's under /tmp) and not others."""
    if len(answer) != 3:
        return answer
    status, kind, message = answer
    return status, kind, re.sub(r"/[^\s'`]+", "<path>", message)


def _vllms_words(answer: tuple) -> tuple:
    """The reference's answer as vLLM writes it: an unknown model's 404 lists the served
    model's alias."""
    answer = _paths_hidden(answer)
    if len(answer) == 3 and answer[0] == 404 and answer[2].startswith("The model `"):
        return answer[0], answer[1], answer[2] + " Valid aliases: <path>"
    return answer


async def test_the_lora_routes_answer_as_vllms(vllm_lora_server, tmp_path) -> None:
    model_dir = vllm_lora_server.model_dir
    base = str(model_dir)
    adapters = make_adapters(model_dir, tmp_path)
    async with httpx.AsyncClient(base_url=vllm_lora_server.url, timeout=120) as http:
        theirs, their_data = await run_script(http, base, adapters)
    async with lora_server(model_dir) as http:
        ours, our_data = await run_script(http, base, adapters)
    assert {k: _vllms_words(v) for k, v in ours.items()} == {
        k: _paths_hidden(v) for k, v in theirs.items()
    }
    for data in (their_data, our_data):
        tokens, logprobs = data["reloaded"]
        assert logprobs == pytest.approx(
            peft_logprobs(model_dir, adapters["a8b"], tokens), abs=1e-4
        )
    assert [card[:2] for card in our_data["cards"]] == [card[:2] for card in their_data["cards"]]
