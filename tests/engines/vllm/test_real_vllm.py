"""Against real vLLM on the CPU: what the trainer reads of its answers, its pause routes, and
the ``gloo`` weight-transfer plugin making it serve exactly the policy's weights."""

from __future__ import annotations

import pytest

from engines.client import InferenceClient
from engines.types import SamplingParams
from sync.transports.broadcast import BroadcastTransport
from tests.engines.vllm.helpers import (
    assert_remote_run_is_exact,
    assert_syncs_make_the_engine_score_as_the_policy,
)

pytestmark = pytest.mark.vllm

PROMPT = [5, 6, 7, 8, 9]


async def test_a_completion_carries_token_ids_logprobs_and_a_finish_reason(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
        first = await client.generate(PROMPT, sampling)
        again = await client.generate(PROMPT, sampling)
    assert 1 <= len(first.token_ids) <= 6
    assert len(first.logprobs) == len(first.token_ids)
    assert all(lp <= 0.0 for lp in first.logprobs)
    assert first.finish_reason in ("length", "stop")
    assert first.finish_reason == "stop" or len(first.token_ids) == 6
    assert (again.token_ids, again.logprobs) == (first.token_ids, first.logprobs)  # seeded


async def test_n_samples_are_the_seeds_seed_plus_i(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        sampling = SamplingParams(max_tokens=6, temperature=1.0, seed=11)
        many = await client.generate_n(PROMPT, sampling, 3)
        assert len(many) == 3
        assert all(len(c.logprobs) == len(c.token_ids) for c in many)


async def test_pause_keep_and_abort_then_resume(vllm_server):
    async with InferenceClient([vllm_server.url]) as client:
        for mode in ("keep", "abort"):
            await client.pause(mode)
            assert await client.is_paused() == [True]
            await client.resume()
            assert await client.is_paused() == [False]
        completion = await client.generate(PROMPT, SamplingParams(max_tokens=2, seed=0))
        assert len(completion.token_ids) >= 1


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
async def test_a_gloo_sync_makes_the_engine_score_as_the_policy(vllm_server, packed):
    """The plugin's engine takes the trainer's unchanged sender. Packed: one
    ``/update_weights`` in several chunks; unpacked: one per bucket, a broadcast per tensor
    (64 KiB: several of either; each test builds its own group, a second init replaces the
    first)."""
    transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120, packed=packed)
    await assert_syncs_make_the_engine_score_as_the_policy(vllm_server, transport)


def test_engine_backend_remote_trains_3_steps_with_exact_weights(vllm_server, tmp_path):
    """The trainer against a vLLM server someone else started (the module's)."""
    assert_remote_run_is_exact(vllm_server, tmp_path)
