"""A run's checkpoint is the trained model: real vLLM serves its ``policy/`` directory as it is
(weights, config, and the tokenizer with its chat template the checkpoint copies there)."""

from __future__ import annotations

import httpx
import pytest
from transformers import AutoTokenizer

pytestmark = pytest.mark.vllm


def test_real_vllm_serves_a_checkpoints_policy_with_its_chat_template(trained_policy_server):
    server = trained_policy_server
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    answer = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={
            "model": str(server.model_dir),
            "messages": messages,
            "max_tokens": 4,
            "temperature": 0.0,
        },
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert isinstance(body["choices"][0]["message"]["content"], str)
    # vLLM rendered the prompt with the checkpoint's own chat template
    tokenizer = AutoTokenizer.from_pretrained(server.model_dir)
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert body["usage"]["prompt_tokens"] == len(prompt["input_ids"])
