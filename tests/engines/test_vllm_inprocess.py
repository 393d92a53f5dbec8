"""engines.vllm_inprocess on a machine without vLLM: the import guard and the conversions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engines import vllm_inprocess
from engines.bridge import open_bridge
from engines.types import SamplingParams
from trainer.errors import EngineStartError

needs_no_vllm = pytest.mark.skipif(vllm_inprocess.VLLM_AVAILABLE, reason="vLLM is installed here")


@needs_no_vllm
async def test_without_vllm_opening_an_engine_says_how_to_get_it() -> None:
    async with open_bridge() as bridge:
        with pytest.raises(EngineStartError) as info:
            async with vllm_inprocess.open_vllm_inprocess(bridge, model="any"):
                pytest.fail("opened vLLM without vLLM")
        with pytest.raises(EngineStartError):
            vllm_inprocess.VLLMInProcessEngine(bridge, llm=None)
    message = str(info.value)
    assert "pip install vllm" in message
    assert "GPU" in message


def test_sampling_params_convert_to_vllm_keywords() -> None:
    params = SamplingParams(
        temperature=0.7, top_p=0.9, max_tokens=32, seed=5, stop_token_ids=(2, 3), ignore_eos=True
    )
    assert vllm_inprocess.to_vllm_sampling_kwargs(params) == {
        "n": 1,
        "temperature": 0.7,
        "top_p": 0.9,
        "max_tokens": 32,
        "seed": 5,
        "stop_token_ids": [2, 3],
        "ignore_eos": True,
        "logprobs": 0,
    }


def test_a_request_output_converts_to_a_completion() -> None:
    logprob = SimpleNamespace
    output = SimpleNamespace(
        prompt_token_ids=[1, 2],
        outputs=[
            SimpleNamespace(
                token_ids=[7, 8],
                logprobs=[
                    {7: logprob(logprob=-0.5)},
                    {8: logprob(logprob=-1.5), 9: logprob(logprob=-0.1)},
                ],
                finish_reason="length",
            )
        ],
    )
    c = vllm_inprocess.completion_from_output(output)
    assert (c.token_ids, c.logprobs, c.finish_reason, c.prompt_token_ids) == (
        [7, 8],
        [-0.5, -1.5],
        "length",
        [1, 2],
    )
    output.outputs[0].finish_reason = None
    assert vllm_inprocess.completion_from_output(output).finish_reason == "abort"
