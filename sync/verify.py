"""``verify_sync``: after a weight sync, does each engine serve exactly the policy's weights?

Each engine samples a fixed probe (``PROBE_TOKENS`` tokens of a fixed prompt, seeded) and
reports each token's logprob; policy rank 0 scores the same tokens; the largest difference
must be within ``tolerance``, or :class:`~trainer.errors.WeightSyncMismatchError` names the
engine, the position and both logprobs. A wrong sync is otherwise silent: the run trains on,
and only ``policy/is_ratio`` drifting shows it (vLLM's CPU build did exactly that with a
tied LM head before ``engines.vllm.tied_head``). One short completion per engine and one forward of the policy.
"""

from __future__ import annotations

from typing import Any

import torch

from engines.client import InferenceClient
from engines.types import EngineClient, SamplingParams
from sync.transports.base import Rank0
from trainer.errors import WeightSyncMismatchError

__all__ = ["DEFAULT_TOLERANCE", "LOW_PRECISION_TOLERANCE", "PROBE_TOKENS", "verify_sync"]

#: Tokens each engine samples for the probe.
PROBE_TOKENS = 8


#: ``sync.verify_tolerance`` unset: by the policy's dtype (others: :data:`LOW_PRECISION_TOLERANCE`).
DEFAULT_TOLERANCE = {"float32": 1e-3, "float64": 1e-3}
LOW_PRECISION_TOLERANCE = 0.1


def _score(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> tuple[list[float], str]:
    """The policy's logprob of each of ``tokens`` after ``prompt``, and its dtype's name (on
    rank 0's thread)."""
    param = next(model.parameters())
    ids = torch.tensor([prompt + tokens], device=param.device)
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    scores = [float(logprobs[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]
    return scores, str(param.dtype).removeprefix("torch.")


async def verify_sync(
    engine: EngineClient,
    workers: Rank0,
    prompt: list[int],
    *,
    tolerance: float | None,
    weight_version: int,
) -> dict[str, float]:
    """Check every engine against the policy (see the module docstring); the largest
    difference as ``sync/verify_max_abs_diff``. ``tolerance`` None: by the policy's dtype
    (:data:`DEFAULT_TOLERANCE`)."""
    worst = 0.0
    sampling = SamplingParams(temperature=1.0, max_tokens=PROBE_TOKENS, ignore_eos=True, seed=0)
    for url in engine.urls:
        # over HTTP each engine is probed where it is (one rejoining is out of rotation)
        pinned: dict[str, Any] = {"url": url} if isinstance(engine, InferenceClient) else {}
        probe = await engine.generate(prompt, sampling, **pinned)
        policy, dtype = await workers.run_on_rank0(_score, list(prompt), list(probe.token_ids))
        bound = tolerance or DEFAULT_TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
        for i, (theirs, ours) in enumerate(zip(probe.logprobs, policy)):
            if abs(theirs - ours) > bound:
                raise WeightSyncMismatchError(
                    url, i, int(probe.token_ids[i]), theirs, ours, bound, weight_version
                )
            worst = max(worst, abs(theirs - ours))
    return {"sync/verify_max_abs_diff": worst}
