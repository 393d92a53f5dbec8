"""Against real vLLM on the CPU: what the trainer reads of its answers, its pause routes, and
the ``gloo`` weight-transfer plugin making it serve exactly the policy's weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import trio

from engines.client import InferenceClient
from engines.types import SamplingParams
from sync.transports.broadcast import BroadcastTransport
from sync.weights import save_weights_for_sampler
from tests.engines.vllm.conftest import PROJECT
from trainer.workers.local import LocalWorkerGroup

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


def _policy_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
async def test_a_gloo_sync_makes_the_engine_score_as_the_policy(vllm_server, packed):
    """The plugin's engine takes the trainer's unchanged sender: after each sync of a moved
    policy, the engine's logprobs of what it samples are the policy's (1e-4). Packed: one
    ``/update_weights`` in several chunks; unpacked: one per bucket, a broadcast per tensor
    (each test builds its own group: a second init replaces the first)."""
    workers = await LocalWorkerGroup.create(
        vllm_server.model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False
    )
    model = workers.policy.model
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    async with InferenceClient([vllm_server.url]) as client:
        # 64 KiB: several chunks (packed) or buckets (unpacked)
        transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120, packed=packed)
        with trio.fail_after(300):
            await transport.init(client, workers)
        try:
            for _ in range(2):
                with torch.no_grad():  # the policy moves away from what the engine serves
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                stale = await client.generate(PROMPT, sampling)
                policy = await trio.to_thread.run_sync(
                    _policy_logprobs, model, PROMPT, stale.token_ids
                )
                assert max(abs(a - b) for a, b in zip(policy, stale.logprobs)) > 1e-3
                with trio.fail_after(300):
                    await save_weights_for_sampler(client, workers, transport)
                fresh = await client.generate(PROMPT, sampling)
                policy = await trio.to_thread.run_sync(
                    _policy_logprobs, model, PROMPT, fresh.token_ids
                )
                assert max(abs(a - b) for a, b in zip(policy, fresh.logprobs)) < 1e-4
        finally:
            await transport.close(workers)


def test_engine_backend_remote_trains_3_steps_with_exact_weights(vllm_server, tmp_path):
    """The trainer against a vLLM server someone else started (the module's)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "trainer", "engine.backend=remote", "sync.transport=gloo"]
    cmd += [f"engine.urls=[{vllm_server.url}]", "model.path=builtin:tiny-vllm"]
    cmd += ["trainer.max_steps=3", f"trainer.run_dir={run_dir}"]
    env = {**os.environ, "PYTHONPATH": str(PROJECT)}
    proc = subprocess.run(cmd, env=env, cwd=PROJECT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert (
            abs(row["policy/is_ratio_min"] - 1) < 1e-3
            and abs(row["policy/is_ratio_max"] - 1) < 1e-3
        )
