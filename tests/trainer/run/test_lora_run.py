"""A LoRA run end to end through the reference engine server (real HTTP): every sync verified
and exact (``policy/is_ratio`` 1) in both sync modes (the merged weights over the disk
transport; the adapter loaded by name), which compute the same run; a resume from its
checkpoint computes what the whole run computed; ``ckpt export`` makes an adapter peft loads
and a merged model directory whose logprobs are the policy's; a load that fails ends the run
typed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import trio

import trainer.run
from trainer.checkpoint import ckpt_main
from trainer.config import load_config
from trainer.errors import FaultInjected

from .test_exact_resume import _computed

#: Metrics of the engine's numerics against the trainer's (which path carried the weights,
#: which batch a sequence was decoded in): equal to rounding between two runs, not to the bit.
ENGINE_NUMERICS = ("policy/is_ratio", "sync/verify", "mismatch/")

COMMON = [
    "engine.backend=local",
    "model.lora.rank=4",
    "model.lora.alpha=16",
    "model.lora.target_modules=[q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj]",
    "optim.lr=0.01",
    "trainer.train_batch_size=4",
    "generator.n_samples_per_prompt=2",
    "trainer.ckpt_interval=2",
    "trainer.progress=false",
    "sync.verify=every",
    "data.reward_fn=tests.trainer.helpers:varied_reward",
    "trainer.max_steps=3",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """The whole run (3 steps, checkpoints at 2 and 3), a run resumed from its step 2, and the
    whole run again with the adapter loaded by the engine (``sync.lora=adapter``)."""
    root = tmp_path_factory.mktemp("lora")
    whole, resumed, adapter = root / "whole", root / "resumed", root / "adapter"

    async def both() -> None:
        await trainer.run.train(load_config(None, [*COMMON, f"trainer.run_dir={whole}"]))
        await trainer.run.train(
            load_config(None, [*COMMON, f"trainer.run_dir={adapter}", "sync.lora=adapter"])
        )
        await trainer.run.train(
            load_config(
                None,
                [
                    *COMMON,
                    f"trainer.run_dir={resumed}",
                    "trainer.resume_mode=path",
                    f"trainer.resume_path={whole / 'checkpoints' / 'global_step_2'}",
                ],
            )
        )

    trio.run(both)
    return whole, resumed, adapter


@pytest.mark.parametrize("mode", ["merged", "adapter"])
def test_every_lora_sync_is_verified_and_exact(runs, mode):
    rows = _computed(runs[0] if mode == "merged" else runs[2])
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["sync/verify_max_abs_diff"] < 1e-4, row["step"]
        assert row["policy/is_ratio_mean"] == pytest.approx(1.0, abs=1e-4), row["step"]
        assert row["policy/grad_norm"] > 0


def test_both_sync_modes_compute_the_same_run_and_the_adapter_moves_a_fraction_of_the_bytes(
    runs,
):
    merged, adapter = _computed(runs[0]), _computed(runs[2])
    merged_bytes = [r.pop("sync/bytes") for r in merged]
    adapter_bytes = [r.pop("sync/bytes") for r in adapter]
    assert max(adapter_bytes) < 0.25 * min(merged_bytes)
    for want, have in zip(merged, adapter, strict=True):
        # the engine's numerics against the trainer's: equal to rounding, not to the bit
        for k in [k for k in want if k.startswith(ENGINE_NUMERICS)]:
            assert have.pop(k) == pytest.approx(want.pop(k), abs=1e-5), k
        want.pop("checkpoint/step", None), have.pop("checkpoint/step", None)
        assert have == want
    # the engine served the adapter by name: its directory, one per sync, the last one kept
    assert [p.name for p in (runs[2] / "weight_sync").iterdir()] == ["lora_v4"]


def test_a_resumed_lora_run_computes_what_the_whole_run_computed(runs):
    whole, resumed, _ = runs
    assert "at step 2" in (resumed / "train.log").read_text()
    want, have = _computed(whole)[2], _computed(resumed)[-1]
    assert have["step"] == want["step"] == 3
    for k in [k for k in want if k.startswith(ENGINE_NUMERICS)]:
        assert have.pop(k) == pytest.approx(want.pop(k), abs=1e-5), k
    assert have == want


def _export(run_dir: Path, out: Path, *flags: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "ckpt", "export", str(run_dir), str(out), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "\r" not in done.stderr
    return done.stdout


def test_the_export_is_an_adapter_peft_loads_and_a_merged_model_with_the_policys_logprobs(
    runs, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    whole = runs[0]
    assert "merged into its base model" in _export(whole, tmp_path / "merged")
    assert ckpt_main(["export", str(whole), str(tmp_path / "adapter"), "--adapter"]) == 0
    base_dir = json.loads(
        (whole / "checkpoints" / "global_step_3" / "policy" / "lora_base.json").read_text()
    )["model_dir"]

    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "merged")
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "1 + 2"}], add_generation_prompt=True, return_dict=True
    )["input_ids"]
    ids = torch.tensor([ids])
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers' old names
        before = base(ids).logits.log_softmax(-1)
        policy = PeftModel.from_pretrained(base, tmp_path / "adapter")(ids).logits.log_softmax(-1)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
        exported = merged(ids).logits.log_softmax(-1)
    torch.testing.assert_close(exported, policy, rtol=0, atol=1e-5)
    assert (policy - before).abs().max() > 1e-3  # the adapter trained: not a comparison of bases
    # modes as made afresh (the checkpoint's files are private 0600): a server's user reads it
    umask = os.umask(0o022)
    os.umask(umask)
    for out in (tmp_path / "merged", tmp_path / "adapter"):
        for path in [out, *out.rglob("*")]:
            want = (0o777 if path.is_dir() else 0o666) & ~umask
            assert path.stat().st_mode & 0o777 == want, path


def test_export_refuses_an_existing_directory_and_a_wrong_base(
    runs, tmp_path, model_dir_other, capsys
):
    whole = runs[0]
    (tmp_path / "taken").mkdir()
    for out, flags, expected in (
        (tmp_path / "taken", (), "already exists"),
        (tmp_path / "x", ("--base", str(model_dir_other)), "is not the model the adapter"),
    ):
        assert ckpt_main(["export", str(whole), str(out), *flags]) == 1
        assert expected in capsys.readouterr().err
        assert not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def model_dir_other(tmp_path_factory) -> Path:
    """A model of the same architecture with other weights."""
    from engines.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("other"), seed=1)


def test_an_adapter_load_that_fails_ends_the_run_typed(tmp_path):
    """The load of the second step's sync fails (an injected error where the transfer
    starts): the run ends with that error after its first step, never generating with the
    engines paused by the bracket."""
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            *COMMON,
            f"trainer.run_dir={run_dir}",
            "sync.lora=adapter",
            "sync.verify=first",
            "trainer.ckpt_interval=0",
            "faults=broadcast_to_inference_engines:error=boom@2",
        ],
    )
    with pytest.raises(FaultInjected):
        trio.run(trainer.run.train, cfg)
    assert [r["step"] for r in _computed(run_dir)] == [1]
