"""Atomic checkpoints: round trips, crashes mid-save, the latest pointer, retention, resume."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.checkpoint import (
    LATEST_FILE,
    CheckpointError,
    CheckpointManager,
    load_model,
    load_state,
    rng_state,
    save_model,
    save_state,
    set_rng_state,
)
from trainer.checkpoint._inspect import list_checkpoints
from trainer.checkpoint._layout import read_trainer_state, verify


@pytest.fixture
def manager(tmp_path: Path) -> CheckpointManager:
    return CheckpointManager(tmp_path / "run" / "checkpoints")


def write_blob(content: bytes = b"weights") -> object:
    def write(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "blob.bin").write_bytes(content)

    return write


def pointer(manager: CheckpointManager) -> str:
    return (manager.root / LATEST_FILE).read_text().strip()


def entries(manager: CheckpointManager) -> list[str]:
    return sorted(p.name for p in manager.root.iterdir())


# --------------------------------------------------------------------------- round trips


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched) -> None:
    ids = torch.arange(12).reshape(2, 6) % 32
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_tiny_qwen2_optimizer_scheduler_and_rng_round_trip(manager):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )

    def build(seed: int):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
        return model, opt, sched

    model, opt, sched = build(0)
    _train_step(model, opt, sched)
    random.seed(5)
    np.random.seed(5)

    def write(directory: Path) -> None:
        save_model(model, directory / "model")
        save_state(opt.state_dict(), directory / "optimizer.pt")
        save_state(sched.state_dict(), directory / "scheduler.pt")
        save_state(rng_state(), directory / "rng.pt")

    path = manager.save(1, write, {"dataloader": {"epoch": 0, "index": 4}})
    expected_draws = (torch.rand(4), random.random(), np.random.rand(2))

    restored, opt2, sched2 = build(1)
    assert not torch.equal(restored.lm_head.weight, model.lm_head.weight)
    load_model(restored, path / "model")
    opt2.load_state_dict(load_state(path / "optimizer.pt"))
    sched2.load_state_dict(load_state(path / "scheduler.pt"))
    torch.manual_seed(123)
    random.seed(123)
    set_rng_state(load_state(path / "rng.pt"))

    for (name, a), b in zip(model.state_dict().items(), restored.state_dict().values()):
        assert torch.equal(a, b), name
    assert restored.lm_head.weight is restored.model.embed_tokens.weight  # still tied
    # the model directory is a Hugging Face model directory
    assert (path / "model" / "config.json").is_file()
    reloaded = Qwen2ForCausalLM.from_pretrained(path / "model")
    assert torch.equal(reloaded.lm_head.weight, model.lm_head.weight)
    assert sched2.last_epoch == sched.last_epoch == 1
    assert torch.equal(torch.rand(4), expected_draws[0])
    assert random.random() == expected_draws[1]
    assert np.array_equal(np.random.rand(2), expected_draws[2])
    # AdamW moments came back: one more identical step gives identical weights
    _train_step(model, opt, sched)
    _train_step(restored, opt2, sched2)
    for a, b in zip(model.parameters(), restored.parameters()):
        assert torch.equal(a, b)
    assert manager.read_trainer_state(path) == {
        "step": 1,
        "dataloader": {"epoch": 0, "index": 4},
    }


def test_plain_module_round_trip_and_strict_key_errors(tmp_path):
    torch.manual_seed(0)
    src = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    save_model(src, tmp_path / "m")
    assert (tmp_path / "m" / "model.safetensors").is_file()
    dst = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    load_model(dst, tmp_path / "m")
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))

    with pytest.raises(CheckpointError, match=r"missing 2 key\(s\) \['2.weight', '2.bias'\]"):
        load_model(torch.nn.Sequential(*src, torch.nn.Linear(2, 2)), tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"unexpected 2 key\(s\) \['1.bias', '1.weight'\]"):
        load_model(torch.nn.Sequential(torch.nn.Linear(3, 4)), tmp_path / "m")
    wider = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Linear(5, 2))
    with pytest.raises(CheckpointError, match=r"wrong shape: \['0.weight: checkpoint \(4, 3\)"):
        load_model(wider, tmp_path / "m")
    with pytest.raises(CheckpointError, match=r"no safetensors weights"):
        load_model(dst, tmp_path)


def test_plain_module_with_tied_weights_round_trips(tmp_path):
    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    torch.manual_seed(0)
    src = Tied()
    save_model(src, tmp_path / "m")
    dst = Tied()
    load_model(dst, tmp_path / "m")
    assert torch.equal(dst.head.weight, src.embed.weight)
    assert dst.head.weight is dst.embed.weight


_unpickled = []


def _side_effect(*args: object) -> None:
    _unpickled.append(args)


class _Arbitrary:
    def __reduce__(self):
        return (_side_effect, ("ran",))


def test_load_state_refuses_arbitrary_pickled_objects(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"weights": torch.ones(2), "payload": _Arbitrary()}, path)
    with pytest.raises(CheckpointError, match=r"refusing to load .*evil.pt.*save a state_dict"):
        load_state(path)
    assert _unpickled == []  # the payload never ran
    save_state({"w": torch.ones(2), "meta": {"lr": 0.1, "betas": (0.9, 0.99)}}, tmp_path / "ok.pt")
    assert load_state(tmp_path / "ok.pt")["meta"] == {"lr": 0.1, "betas": (0.9, 0.99)}


def test_set_rng_state_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"unknown RNG state keys \['jax'\]"):
        set_rng_state({"jax": 1})


# --------------------------------------------------------------------------- save protocol


def test_save_writes_layout_trainer_state_and_manifest(manager):
    path = manager.save(2, write_blob(), {"config_hash": "abc"})
    assert path == manager.root / "global_step_2"
    assert entries(manager) == ["global_step_2", "latest"]
    assert pointer(manager) == "global_step_2"
    manifest = json.loads((path / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model/blob.bin", "trainer_state.json"]
    assert manifest["files"]["model/blob.bin"]["size"] == len(b"weights")
    assert manager.read_trainer_state(path) == {"step": 2, "config_hash": "abc"}
    assert manager.verify(path) == []
    assert manager.latest() == path


def test_crash_mid_save_leaves_no_step_dir_and_latest_unchanged(manager):
    manager.save(1, write_blob(), {})

    def crashing_write(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "half.bin").write_bytes(b"partial")
        raise OSError("disk full")

    with pytest.raises(OSError, match=r"disk full"):
        manager.save(2, crashing_write, {})
    assert entries(manager) == ["global_step_1", "latest"]  # no step 2, no temp dir
    assert pointer(manager) == "global_step_1"
    assert manager.latest() == manager.root / "global_step_1"

    assert manager.save(2, write_blob(), {}) == manager.root / "global_step_2"
    assert pointer(manager) == "global_step_2"


def test_a_killed_save_leaves_only_a_temp_dir_that_the_next_save_removes(manager, caplog):
    manager.save(1, write_blob(), {})
    # what SIGKILL during write() leaves behind
    stale = manager.root / ".tmp-global_step_2-dead"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "half.bin").write_bytes(b"partial")
    assert manager.latest() == manager.root / "global_step_1"
    assert [info.step for info in list_checkpoints(manager.root)] == [1]

    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        manager.save(2, write_blob(), {})
    assert not stale.exists()
    assert "interrupted checkpoint write" in caplog.text
    assert entries(manager) == ["global_step_1", "global_step_2", "latest"]


def test_latest_is_written_last_after_the_checkpoint_is_complete(manager, monkeypatch):
    events: list[str] = []
    real_rename, real_replace = os.rename, os.replace

    def rename(src, dst):
        events.append(f"rename {Path(src).name[:5]} -> {Path(dst).name}")
        real_rename(src, dst)

    def replace(src, dst):
        # at the moment the pointer moves, the checkpoint it names is complete and intact
        assert manager.verify(manager.root / "global_step_3") == []
        events.append(f"replace -> {Path(dst).name}")
        real_replace(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "replace", replace)
    manager.save(3, write_blob(), {})
    assert events == ["rename .tmp- -> global_step_3", "replace -> latest"]


def test_crash_before_the_pointer_moves_keeps_the_old_latest(manager, monkeypatch, caplog):
    manager.save(1, write_blob(), {})

    def failing_replace(src, dst):
        raise OSError("killed")

    monkeypatch.setattr(os, "replace", failing_replace)
    with pytest.raises(OSError, match=r"killed"):
        manager.save(2, write_blob(), {})
    monkeypatch.undo()
    # step 2 is complete but the pointer still names step 1: the pointer wins
    assert entries(manager) == ["global_step_1", "global_step_2", "latest"]
    assert manager.latest() == manager.root / "global_step_1"

    # with the pointer lost as well, the highest complete step is used, with a warning
    (manager.root / LATEST_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert manager.latest() == manager.root / "global_step_2"
    assert "is missing; falling back to the highest complete step" in caplog.text


def test_corrupt_pointer_falls_back_to_highest_complete_step(manager, caplog):
    manager.save(1, write_blob(), {})
    manager.save(2, write_blob(), {})
    (manager.root / "global_step_3").mkdir()  # not complete: no manifest
    (manager.root / LATEST_FILE).write_text("global_step_3\n")
    with caplog.at_level(logging.WARNING, logger="trainer.checkpoint"):
        assert manager.latest() == manager.root / "global_step_2"
    assert "'global_step_3', which is not a complete checkpoint" in caplog.text
    (manager.root / LATEST_FILE).write_bytes(b"\xff\xfe garbage")
    assert manager.latest() == manager.root / "global_step_2"


def test_saving_a_step_again_replaces_it(manager):
    manager.save(4, write_blob(b"first"), {"n": 1})
    path = manager.save(4, write_blob(b"second"), {"n": 2})
    assert (path / "model" / "blob.bin").read_bytes() == b"second"
    assert manager.read_trainer_state(path)["n"] == 2
    assert entries(manager) == ["global_step_4", "latest"]
    assert manager.verify(path) == []


@pytest.mark.parametrize(
    ("step", "state", "match"),
    [
        (-1, {}, "step must be an int >= 0"),
        (1, {"step": 2}, r"trainer_state\['step'\] is 2 but the checkpoint is for step 1"),
        (1, {"loss": float("nan")}, "must be JSON-serializable"),
        (1, {"obj": object()}, "must be JSON-serializable"),
    ],
)
def test_bad_save_arguments_fail_before_writing_anything(manager, step, state, match):
    def write(directory: Path) -> None:
        raise AssertionError("write must not be called")

    with pytest.raises(ValueError, match=match):
        manager.save(step, write, state)
    assert not manager.root.exists()


def test_writer_may_not_create_manager_files(manager):
    def write(directory: Path) -> None:
        (directory / "manifest.json").write_text("{}")

    with pytest.raises(CheckpointError, match=r"writer created manifest.json"):
        manager.save(1, write, {})
    assert not (manager.root / "global_step_1").exists()


# --------------------------------------------------------------------------- retention


def test_retention_keeps_the_newest_and_never_the_latest_target(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints", max_to_keep=2)
    for step in range(1, 6):
        manager.save(step, write_blob(), {})
    assert [i.step for i in list_checkpoints(manager.root)] == [4, 5]
    assert [i.is_latest for i in list_checkpoints(manager.root)] == [False, True]

    unbounded = CheckpointManager(tmp_path / "c2")
    for step in (1, 2, 3, 4):
        unbounded.save(step, write_blob(), {})
    (unbounded.root / LATEST_FILE).write_text("global_step_2\n")  # e.g. resumed from step 2
    removed = unbounded.prune(1)
    assert removed == [unbounded.root / "global_step_1", unbounded.root / "global_step_3"]
    assert entries(unbounded) == ["global_step_2", "global_step_4", "latest"]
    with pytest.raises(ValueError, match=r"keep must be >= 1"):
        unbounded.prune(0)
    with pytest.raises(ValueError, match=r"None \(keep every checkpoint\) or >= 1"):
        CheckpointManager(tmp_path, max_to_keep=0)


# --------------------------------------------------------------------------- resolve


def test_resolve_none_and_latest(manager):
    assert manager.resolve("none", None) is None
    assert manager.resolve("latest", None) is None  # nothing saved yet: start fresh
    manager.save(1, write_blob(), {})
    path = manager.save(2, write_blob(), {})
    assert manager.resolve("none", str(path)) is None
    assert manager.resolve("latest", None) == path
    (path / "model" / "blob.bin").write_bytes(b"corrupt")
    with pytest.raises(
        CheckpointError, match=r"global_step_2 failed verification: .*resume_mode=path"
    ):
        manager.resolve("latest", None)
    with pytest.raises(
        ValueError, match=r"unknown resume_mode 'auto'; allowed: none, latest, path"
    ):
        manager.resolve("auto", None)  # type: ignore[arg-type]


def test_resolve_path_validates_the_directory(manager, tmp_path):
    path = manager.save(1, write_blob(), {})
    assert manager.resolve("path", str(path)) == path
    with pytest.raises(ValueError, match=r"needs trainer.resume_path=DIR"):
        manager.resolve("path", None)
    with pytest.raises(CheckpointError, match=r"'.*missing' does not exist"):
        manager.resolve("path", str(tmp_path / "missing"))
    with pytest.raises(CheckpointError, match=r"point at one global_step_N inside it"):
        manager.resolve("path", str(manager.root))
    with pytest.raises(CheckpointError, match=r"point at one global_step_N inside it"):
        manager.resolve("path", str(tmp_path / "run"))
    (tmp_path / "half").mkdir()
    with pytest.raises(CheckpointError, match=r"not a complete checkpoint .*interrupted save"):
        manager.resolve("path", str(tmp_path / "half"))
    (path / "trainer_state.json").write_text('{"step": 1, "edited": true}')
    with pytest.raises(
        CheckpointError, match=r"trainer_state.json: size 27 bytes, manifest says 16"
    ):
        manager.resolve("path", str(path))


def test_checkpoint_error_pickles():
    err = pickle.loads(pickle.dumps(CheckpointError("checkpoint x is bad")))
    assert isinstance(err, CheckpointError) and str(err) == "checkpoint x is bad"


def test_reading_and_verifying_stay_reachable_from_the_manager():
    # the face's names are pinned in tests/trainer/test_public_api.py
    assert CheckpointManager.read_trainer_state is read_trainer_state
    assert CheckpointManager.verify is verify
