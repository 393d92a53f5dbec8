"""The check every weight transport into every engine must pass: after a sync, the engine
scores what it samples exactly as the policy does (reference servers and real vLLM alike)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import trio

from engines.client import InferenceClient
from engines.types import SamplingParams
from sync.weights import sync_weights
from trainer.workers.local import LocalWorkerGroup

__all__ = ["PROMPT", "VERSIONS", "policy_logprobs", "syncs_make_the_engine_score_as_the_policy"]

PROMPT = [5, 6, 7, 8, 9]
#: The weight versions of the two syncs (the engine serves the last one afterwards).
VERSIONS = (41, 42)


def policy_logprobs(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> list[float]:
    """The policy's logprob of each of ``tokens`` after ``prompt``."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


async def syncs_make_the_engine_score_as_the_policy(
    url: str,
    model_dir: Path,
    transport: Any,
    tolerance: float = 1e-4,
    api_key: str | None = None,
) -> None:
    """Twice: move the policy away from what the engine serves (checked: its logprobs differ
    by more than 1e-3), sync through ``transport`` (as weight versions :data:`VERSIONS`), and
    the engine's logprobs of what it samples are the policy's within ``tolerance`` (float32
    rounding of another implementation of the same model: 1e-4 on the tiny model). ``api_key``:
    the server's secret, where it asks for one."""
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    model = workers.policy.model
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=0)
    async with InferenceClient([url], api_key=api_key) as client:
        with trio.fail_after(300):
            await transport.init(client, workers)
        try:
            for version in VERSIONS:
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(0.05 * torch.randn_like(p))
                stale = await client.generate(PROMPT, sampling)
                policy = await trio.to_thread.run_sync(
                    policy_logprobs, model, PROMPT, stale.token_ids
                )
                assert max(abs(a - b) for a, b in zip(policy, stale.logprobs)) > 1e-3
                with trio.fail_after(300):
                    await sync_weights(client, workers, transport, weight_version=version)
                fresh = await client.generate(PROMPT, sampling)
                policy = await trio.to_thread.run_sync(
                    policy_logprobs, model, PROMPT, fresh.token_ids
                )
                gap = max(abs(a - b) for a, b in zip(policy, fresh.logprobs))
                assert gap < tolerance, (gap, policy, fresh.logprobs)
        finally:
            await transport.close(workers)
