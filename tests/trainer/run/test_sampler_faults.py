"""The sampler-skewing faults (issue 61): each makes the reference engine disagree with the
trainer on purpose, silently, and each test shows what catches it in the step it appears."""

from __future__ import annotations

import json
import logging

import pytest

import trainer.run
from trainer.config import load_config
from trainer.errors import ConfigError, WeightSyncMismatchError
from trainer.vocabulary import (
    FaultAction,
    Faults,
    fire_fault_sync,
    install_faults,
    sampler_skew,
)

RUN = ["trainer.progress=false", "trainer.max_steps=2"]


@pytest.mark.parametrize(
    ("spec", "action", "inside", "outside"),
    [
        ("/finish_weight_update:stale@1", FaultAction.STALE, 1, 2),
        ("/update_weights:drop_bucket@2-3", FaultAction.DROP_BUCKET, 3, None),
        ("generate:bf16_logits@2", FaultAction.BF16_LOGITS, 2, 1),
        ("/v1/load_lora_adapter:skip_load@4", FaultAction.SKIP_LOAD, 4, 3),
    ],
)
def test_each_is_declared_at_its_operation_and_asked_for_not_fired(spec, action, inside, outside):
    assert Faults.parse(spec).spec == spec
    install_faults(spec)
    op = spec.split(":")[0]
    fire_fault_sync(op, inside)  # neither hangs, waits nor raises: the engine asks for it
    assert sampler_skew(op, inside) is action
    assert sampler_skew(op, outside) is None


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("generate:stale", "stale fires at /finish_weight_update only"),
        ("/finish_weight_update:drop_bucket", "drop_bucket fires at /update_weights only"),
        ("generate:bf16_logits=1", "bf16_logits takes no value"),
        ("/update_weights:skip_load", "skip_load fires at /v1/load_lora_adapter only"),
    ],
)
def test_at_another_operation_or_with_a_value_they_are_refused(spec, says):
    with pytest.raises(ConfigError, match=says):
        Faults.parse(spec)


def test_an_engine_that_is_not_the_reference_one_is_refused_at_load():
    with pytest.raises(ConfigError, match="bf16_logits makes the reference engine disagree"):
        load_config(None, ["engine.backend=vllm", "faults=generate:bf16_logits"])


def test_a_skipped_adapter_load_needs_an_adapter_sync():
    with pytest.raises(ConfigError, match=r"set model\.lora\.rank=N, sync\.lora=adapter"):
        load_config(None, ["engine.backend=local", "faults=/v1/load_lora_adapter:skip_load@1"])
    load_config(None, ["engine.backend=local", *LORA, "faults=/v1/load_lora_adapter:skip_load@1"])


LORA = ["model.lora.rank=8", "sync.lora=adapter"]


@pytest.mark.parametrize(
    ("spec", "more"),
    [
        ("/finish_weight_update:stale@1", []),
        ("/update_weights:drop_bucket@1", []),
        ("/v1/load_lora_adapter:skip_load@1", LORA),  # the previous adapter serves on
    ],
)
async def test_a_sync_the_engine_did_not_apply_ends_the_run_at_sync_verify(tmp_path, spec, more):
    # the step-1 sync is acknowledged (no error anywhere) but leaves the old weights serving
    over = ["engine.backend=local", "sync.verify=every", f"faults={spec}", *more]
    cfg = load_config(None, [*RUN, *over, f"trainer.run_dir={tmp_path}"])
    with pytest.raises(WeightSyncMismatchError) as info:
        await trainer.run.train(cfg)
    assert info.value.weight_version == 2  # the initial sync is 1: the one after step 1
    assert "sync.verify_tolerance 0.001" in str(info.value)


async def test_bf16_logits_warn_in_the_step_they_appear(tmp_path, caplog):
    # bfloat16 rounding is below sync.verify's probe tolerance and 0.1 (what a bf16 engine
    # gives): a threshold at float32's level catches it in step 2, and step 1 stays clean
    over = [
        "engine.backend=inprocess",
        "sync.verify=never",
        "faults=generate:bf16_logits@2",
        "algorithm.mismatch.max_logprob_abs_diff_mean=1e-4",
        f"trainer.run_dir={tmp_path}",
    ]
    with caplog.at_level(logging.WARNING, logger="trainer.mismatch"):
        await trainer.run.train(load_config(None, [*RUN, *over]))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "mismatch/crossed" in r]
    assert [r["mismatch/crossed"] for r in rows] == [0.0, 1.0]
    assert rows[0]["mismatch/logprob_abs_diff_mean"] < 1e-5
    assert 1e-4 < rows[1]["mismatch/logprob_abs_diff_mean"] < 1e-2
    (record,) = caplog.records
    assert record.getMessage().startswith("step 2: mismatch/logprob_abs_diff_mean=")
