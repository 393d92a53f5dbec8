"""The on-disk checkpoint format: step directory names, the manifest, the trainer state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.checkpoint._layout import (
    MANIFEST_FILE,
    TRAINER_STATE_FILE,
    is_complete,
    parse_step_dir_name,
    read_trainer_state,
    step_dirs,
    verify,
    write_manifest,
)
from trainer.errors import CheckpointError


def make_checkpoint(directory: Path, step: int, blob: bytes = b"0123456789") -> Path:
    """A checkpoint as ``CheckpointManager.save`` leaves it, written without the manager."""
    (directory / "model").mkdir(parents=True)
    (directory / "model" / "blob.bin").write_bytes(blob)
    (directory / TRAINER_STATE_FILE).write_text(json.dumps({"step": step}) + "\n")
    write_manifest(directory, step)
    return directory


def test_step_dir_names_are_global_step_and_a_plain_number(tmp_path):
    assert parse_step_dir_name("global_step_0") == 0
    assert parse_step_dir_name("global_step_12") == 12
    for name in ("global_step_07", "global_step_-1", "global_step_", "latest", ".tmp-x"):
        assert parse_step_dir_name(name) is None, name

    for name in ("global_step_10", "global_step_9", ".tmp-global_step_11-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "global_step_12").write_text("a file, not a checkpoint")
    assert step_dirs(tmp_path) == [
        (9, tmp_path / "global_step_9"),
        (10, tmp_path / "global_step_10"),
    ]
    assert step_dirs(tmp_path / "missing") == []


def test_write_manifest_lists_every_file_and_returns_their_total_size(tmp_path):
    path = tmp_path / "global_step_3"
    (path / "model").mkdir(parents=True)
    (path / "model" / "blob.bin").write_bytes(b"0123456789")
    (path / TRAINER_STATE_FILE).write_text('{"step": 3}\n')
    assert write_manifest(path, 3) == 10 + 12
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 3
    assert sorted(manifest["files"]) == ["model/blob.bin", "trainer_state.json"]
    assert manifest["files"]["model/blob.bin"]["size"] == 10
    assert is_complete(path) and verify(path) == []
    assert not is_complete(tmp_path)


def test_verify_detects_corruption(tmp_path):
    path = make_checkpoint(tmp_path / "global_step_1", 1)
    blob = path / "model" / "blob.bin"
    blob.write_bytes(b"0123456788")  # one byte changed, same size
    assert verify(path) == [
        "model/blob.bin: sha256 differs from the manifest (corrupted or modified)"
    ]
    blob.write_bytes(b"012")
    assert verify(path) == ["model/blob.bin: size 3 bytes, manifest says 10"]
    blob.unlink()
    (path / "extra.txt").write_text("hi")
    assert verify(path) == [
        "model/blob.bin: missing",
        "extra.txt: not in the manifest (added after the save)",
    ]
    (path / "manifest.json").unlink()
    assert verify(path) == ["manifest.json is missing (an interrupted save, or not a checkpoint)"]
    assert verify(path / "nope") == [f"{path / 'nope'} is not a directory"]


def test_verify_detects_a_checkpoint_under_another_steps_name(tmp_path):
    make_checkpoint(tmp_path / "global_step_3", 3).rename(tmp_path / "global_step_4")
    assert verify(tmp_path / "global_step_4") == [
        "trainer_state.json says step 3, directory global_step_4"
    ]


def test_read_trainer_state_errors(tmp_path):
    with pytest.raises(CheckpointError, match=r"trainer_state.json is missing"):
        read_trainer_state(tmp_path)
    (tmp_path / "trainer_state.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"is unreadable"):
        read_trainer_state(tmp_path)
    (tmp_path / "trainer_state.json").write_text("[1]")
    with pytest.raises(CheckpointError, match=r"JSON object with an integer 'step'"):
        read_trainer_state(tmp_path)
