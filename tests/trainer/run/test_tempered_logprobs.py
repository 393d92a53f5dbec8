"""At a temperature other than 1 the engines report the logprobs of the distribution they
sampled from (``--logprobs-mode processed_logprobs``), as the trainer computes its own: every
importance ratio is 1 and the mismatch diagnostics see nothing. With the engines' raw logprobs
(vLLM's default, and the reference engine's before) the ratio was off by the temperature
(mean |diff| 0.05 at 0.7), and every rollout correction with it."""

from __future__ import annotations

import math

import pytest
import torch

from engines.local.decode import decode_step
from engines.models import build_tiny_model
from tests.e2e.helpers import read_metrics, run_trainer

RUN = (
    "trainer.max_steps=2",
    "trainer.train_batch_size=4",
    "generator.n_samples_per_prompt=2",
    "generator.sampling.temperature=0.7",
    "trainer.progress=false",
)


@pytest.mark.parametrize("backend", ["local", "inprocess"])
def test_the_engines_logprobs_are_the_sampling_distributions(tmp_path, backend):
    proc = run_trainer(*RUN, f"engine.backend={backend}", f"trainer.run_dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert abs(row["policy/is_ratio_min"] - 1) < 1e-4, row
        assert abs(row["policy/is_ratio_max"] - 1) < 1e-4, row
        assert row["mismatch/logprob_abs_diff_max"] < 1e-4, row


class _Params:
    def __init__(self, temperature: float) -> None:
        self.temperature, self.top_p, self.top_logprobs = temperature, 1.0, 0
        self.prompt_logprobs = None


class _Request:
    def __init__(self, temperature: float) -> None:
        self.prompt_ids, self.out_ids = [1, 2, 3], []
        self.params, self.kv, self.adapter, self.bf16_logits = (
            _Params(temperature),
            None,
            None,
            False,
        )
        self.generator = torch.Generator().manual_seed(0)
        self.prompt_scores = None


def test_processed_logprobs_are_the_tempered_softmax_and_raw_ones_are_not():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_model()).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3]])).logits[0, -1]
    for temperature in (0.5, 1.0, 0.0):
        raw = decode_step(model, [_Request(temperature)], pad_id=0)
        processed = decode_step(model, [_Request(temperature)], pad_id=0, processed=True)
        assert raw.tokens == processed.tokens  # the same draw: only what is reported differs
        token = raw.tokens[0]
        scale = temperature if temperature > 0 else 1.0  # greedy: the raw logits
        want = torch.log_softmax(logits / scale, dim=-1)[token].item()
        assert math.isclose(processed.logprobs[0], want, abs_tol=1e-5)
        assert math.isclose(
            raw.logprobs[0], torch.log_softmax(logits, -1)[token].item(), abs_tol=1e-5
        )
    assert not math.isclose(  # at 0.5 the two differ: the bug this guards against
        decode_step(model, [_Request(0.5)], pad_id=0).logprobs[0],
        decode_step(model, [_Request(0.5)], pad_id=0, processed=True).logprobs[0],
        abs_tol=1e-3,
    )
