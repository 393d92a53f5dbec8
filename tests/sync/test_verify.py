"""``sync.verify``: after a sync the reference engine scores the probe as the policy does; an
engine serving other weights than the policy's is caught, named, before training goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engines.client import InferenceClient
from sync.verify import verify_sync
from sync.weights import sync_weights
from tests.sync.test_bracket_orders import disk_sync_setup
from trainer.errors import WeightSyncMismatchError

PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


async def test_a_complete_sync_passes_and_a_policy_that_moved_on_is_caught(
    client: InferenceClient, tmp_path: Path
) -> None:
    workers, transport = await disk_sync_setup(client, tmp_path)
    await sync_weights(client, workers, transport)
    ok = await verify_sync(client, workers, PROMPT, tolerance=None, weight_version=1)
    assert ok["sync/verify_max_abs_diff"] < 1e-3  # float32 policy: the default bound
    with torch.no_grad():  # the engine now serves other weights than the policy's
        head = workers.policy.model.lm_head.weight
        head.add_(0.5 * torch.randn_like(head))
    with pytest.raises(WeightSyncMismatchError) as info:
        await verify_sync(client, workers, PROMPT, tolerance=None, weight_version=1)
    err = info.value
    assert err.url == client.urls[0] and err.tolerance == 1e-3 and err.position >= 0
    assert abs(err.engine_logprob - err.policy_logprob) > 1e-3
    assert "sync.verify_tolerance" in str(err)
