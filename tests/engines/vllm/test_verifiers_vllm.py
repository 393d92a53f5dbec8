"""verifiers 0.4 episodes against real vLLM on the CPU: the example's reasoning-gym taskset
(``examples/verifiers_reasoning_gym``) trained through the tier's shared ``gloo`` server
(``vllm serve --enable-scale-out``: the token-in route ``/inference/v1/generate`` that
verifiers' training client calls), with ``engine.backend=remote`` in the test's own Python.

Skipped where verifiers is not installed (``pip install -e '.[verifiers]'``, which setup.sh
and CI do).
"""

from __future__ import annotations

import json

import pytest

from tests.engines.vllm.helpers import assert_exact_steps, run_remote

pytest.importorskip("verifiers.v1", reason="verifiers is an extra: pip install -e '.[verifiers]'")
pytest.importorskip("reasoning_gym", reason="pip install -e '.[verifiers]'")

pytestmark = pytest.mark.vllm

VERIFIERS = (
    "generator.cls=trainer.generators.verifiers_env:VerifiersGenerator",
    'generator.kwargs.taskset={"id": "examples.verifiers_reasoning_gym", "size": 8}',
    'generator.kwargs.harness={"id": "examples.verifiers_reasoning_gym.harness"}',
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=4",
    "generator.sampling.max_tokens=6",
)


def test_the_verifiers_example_trains_through_real_vllm_with_exact_weights(vllm_server, tmp_path):
    proc = run_remote(vllm_server, tmp_path / "run", 2, *VERIFIERS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each step sampled by vLLM with exactly the policy's weights, read from verifiers' traces
    rows = assert_exact_steps(tmp_path / "run", 2)
    for row in rows:
        assert row["generate/failed_episodes"] == 0, row
        assert row["generate/num_turns_mean"] == 1.0
        assert row["reward/mean"] == 0.0  # reasoning-gym's scorer: no <answer> from this model
    config = (tmp_path / "run" / "config.yaml").read_text()
    assert "verifiers_reasoning_gym" in config, json.dumps(rows[0])[:300]


async def test_renderers_rejects_real_vllms_token_in_answer_and_reads_it_through_the_proxy(
    vllm_server,
):
    """Real vLLM 0.32 answers the token-in route with logprob entries by ``token_id`` only;
    renderers 0.1.12 (verifiers' client) refuses that, and reads it through the capture
    proxy's adapter, the engine's own tokens and logprobs."""
    from renderers import MalformedGenerateResponseError

    from engines.bridge import open_bridge
    from engines.client import InferenceClient
    from engines.types import SamplingParams
    from tests.trainer.generators.test_verifiers_env import renderers_generate
    from trainer.generators.token_capture import open_capture_proxy

    model_dir = vllm_server.model_dir
    async with (
        InferenceClient([vllm_server.url]) as engine,
        open_capture_proxy(engine, SamplingParams(temperature=1.0, max_tokens=4)) as proxy,
        open_bridge() as bridge,
    ):
        with pytest.raises(MalformedGenerateResponseError, match="token_id:"):
            await bridge.run(renderers_generate, f"{vllm_server.url}/v1", model_dir)
        answer = await bridge.run(renderers_generate, proxy.register("t", 7), model_dir)
        (turn,) = proxy.turns("t")
    assert answer["completion_ids"] == turn.completion_ids and turn.completion_ids
    assert answer["completion_logprobs"] == turn.logprobs
