"""Against real vLLM on the CPU with the plugin's ``disk`` backend: the trainer's unchanged
``sync.transport=disk`` (safetensors buckets, vLLM's four-phase routes) makes it serve exactly
the policy's weights."""

from __future__ import annotations

import pytest

from sync.transports.disk import DiskTransport
from tests.engines.vllm.helpers import (
    assert_remote_run_is_exact,
    assert_syncs_make_the_engine_score_as_the_policy,
)

pytestmark = pytest.mark.vllm


async def test_a_disk_sync_makes_the_engine_score_as_the_policy(vllm_disk_server, tmp_path):
    """16 KiB buckets: one file, and one ``/update_weights``, per few tensors."""
    transport = DiskTransport(tmp_path / "weight_sync", 16 * 1024)
    await assert_syncs_make_the_engine_score_as_the_policy(vllm_disk_server, transport)


def test_engine_backend_remote_trains_3_steps_with_exact_weights_over_disk(
    vllm_disk_server, tmp_path
):
    assert_remote_run_is_exact(vllm_disk_server, tmp_path)
