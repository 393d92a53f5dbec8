"""The Tinker service's sampling clients on real vLLM (``engine.backend=vllm``: ``vllm serve``'s
CPU build, started by the service as a run starts it, with ``--enable-lora``): the official
SDK's sampling scenario (``tests/tinker/sdk_sampling.py``) passes the same checks as on the
reference engine (``tests/tinker/test_sampling_client.py``): sampled and prompt logprobs equal
the trained policy's forward within 1e-4, seeds, stop tokens, named saves, the base model's
sampler, unloaded samplers. One service of its own, in ``.venv-vllm``; skipped without
``.venv-tinker`` (``bash setup.sh --tinker``)."""

from __future__ import annotations

import pytest

from tests.engines.vllm.servers import VLLM_PYTHON
from tests.tinker import test_sampling_client as checks
from tests.tinker.conftest import SDK_PYTHON, open_service

pytestmark = pytest.mark.vllm

#: The service imports the trainer in .venv-vllm; vLLM itself starts on the first save.
START_TIMEOUT_S = 180.0


def test_the_sdks_sampling_clients_on_real_vllm(tmp_path) -> None:
    if not SDK_PYTHON.exists():
        pytest.skip(".venv-tinker is missing: bash setup.sh --tinker")
    log = tmp_path / "serve.log"
    with open_service(
        tmp_path, "engine.backend=vllm", python=VLLM_PYTHON, start_timeout_s=START_TIMEOUT_S
    ) as service:
        sampled = service.sdk("sample", timeout_s=900)
    assert "engine of tiny up (vllm serve)" in log.read_text()
    checks.test_sampled_logprobs_equal_the_trained_policys(sampled)
    checks.test_a_seed_reproduces_its_samples(sampled)
    checks.test_a_stop_token_ends_the_sample_with_it(sampled)
    checks.test_a_named_save_samples_the_same_weights_through_its_path(sampled)
    checks.test_the_base_models_sampler_samples_the_base_model(sampled)
    checks.test_prompt_logprobs_are_the_models_own_at_any_temperature(sampled)
    checks.test_top_k_prompt_logprobs_are_the_base_models_best(sampled)
    checks.test_old_unnamed_samplers_are_unloaded_and_named_ones_kept(sampled)
