"""Listing a run's checkpoints: steps in order, sizes, which one is latest, which are complete."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import LATEST_FILE, CheckpointManager
from trainer.checkpoint._inspect import list_checkpoints


def write_blob(content: bytes) -> object:
    def write(directory: Path) -> None:
        (directory / "model").mkdir()
        (directory / "model" / "blob.bin").write_bytes(content)

    return write


def test_list_reports_size_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path / "run" / "checkpoints")
    manager.save(1, write_blob(b"x" * 10), {})
    manager.save(2, write_blob(b"x" * 20), {})
    infos = list_checkpoints(manager.root)
    assert [(i.step, i.is_latest, i.complete) for i in infos] == [(1, False, True), (2, True, True)]
    assert infos[1].size - infos[0].size == 10
    assert infos[1].path == manager.root / "global_step_2"


def test_list_shows_incomplete_directories_and_follows_the_pointer(tmp_path):
    manager = CheckpointManager(tmp_path / "checkpoints")
    manager.save(1, write_blob(b"x"), {})
    manager.save(2, write_blob(b"x"), {})
    (manager.root / "global_step_3").mkdir()  # e.g. copied in by hand, half way
    (manager.root / LATEST_FILE).write_text("global_step_1\n")  # e.g. resumed from step 1
    infos = list_checkpoints(str(manager.root))
    assert [(i.step, i.is_latest, i.complete) for i in infos] == [
        (1, True, True),
        (2, False, True),
        (3, False, False),
    ]
    assert list_checkpoints(tmp_path / "missing") == []
