"""What the training service's sampling reads of the configuration, decided once at start
(``trainer.serve.spec_of``): the engines the trainer starts (``engine.*``) and its sync's
check (``sync.*``); an engine backend it cannot sample on is refused in one line."""

from __future__ import annotations

import pytest

from trainer.config import ROLLOUT_LOGPROBS_MODE, load_config
from trainer.errors import ConfigError
from trainer.serve import spec_of


def test_the_samplers_settings_come_from_the_engine_and_sync_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRAINER_SERVE_API_KEY", "tml-test")
    overrides = ["sync.verify=every", "sync.verify_tolerance=0.01", "trainer.seed=5"]
    sampling = spec_of(load_config(None, [*overrides, "engine.startup_timeout_s=77"])).sampling
    assert (sampling.verify, sampling.verify_tolerance, sampling.seed) == ("every", 0.01, 5)
    assert sampling.startup_timeout_s == 77
    # the engine reports the sampling distribution's logprobs, as a run's engines do
    assert sampling.logprobs_mode == ROLLOUT_LOGPROBS_MODE


def test_an_engine_backend_the_service_cannot_sample_on_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRAINER_SERVE_API_KEY", "tml-test")
    with pytest.raises(ConfigError, match=r"engine.backend='inprocess' does not sample for"):
        spec_of(load_config(None, ["engine.backend=inprocess"]))


def test_vllm_samples_with_lora_and_no_weight_transfer_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``engine.backend=vllm``: the run plan's ``vllm serve`` settings, LoRA on (adapters go
    by route, ``--max-lora-rank`` 64), no weight-transfer engine."""
    monkeypatch.setenv("TRAINER_SERVE_API_KEY", "tml-test")
    vllm = spec_of(load_config(None, ["engine.backend=vllm"])).sampling.vllm
    assert vllm is not None
    assert (vllm.max_lora_rank, vllm.weight_transfer_backend) == (64, None)
    assert vllm.logprobs_mode == ROLLOUT_LOGPROBS_MODE
    assert spec_of(load_config(None, [])).sampling.vllm is None  # the reference engine
