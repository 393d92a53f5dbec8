"""A checkpoint is its user's alone (folders 0700, files 0600, whoever wrote them), and
pruning never follows a step folder that is a link: the link alone goes, said so, nothing left."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from trainer.checkpoint import CheckpointManager, ckpt_main


def _write(directory: Path) -> None:
    """A worker's files, written with the umask's modes (0644 and 0755 under umask 022)."""
    (directory / "policy").mkdir(mode=0o755)
    (directory / "policy" / "model.safetensors").write_bytes(b"w" * 16)
    (directory / "optimizer.pt").write_bytes(b"o" * 16)
    os.chmod(directory / "optimizer.pt", 0o644)


def _modes(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): stat.S_IMODE(p.lstat().st_mode) for p in root.rglob("*")}


def test_a_saved_checkpoint_has_folders_0700_and_files_0600_whatever_its_writer_made(tmp_path):
    root = tmp_path / "checkpoints"
    CheckpointManager(root).save(1, _write, {})
    modes = _modes(root)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert {"latest", "global_step_1/trainer_state.json", "global_step_1/manifest.json"} <= set(
        modes
    )
    for name, mode in modes.items():
        assert mode == (0o700 if (root / name).is_dir() else 0o600), f"{name}: {mode:04o}"


def _step_link(root: Path, tmp_path: Path, step: int) -> tuple[Path, Path]:
    """``global_step_STEP`` as a link to a checkpoint kept elsewhere."""
    elsewhere = CheckpointManager(tmp_path / "elsewhere").save(step, _write, {})
    link = root / f"global_step_{step}"
    link.symlink_to(elsewhere)
    return link, elsewhere


def test_prune_removes_a_linked_step_folder_as_a_link_and_says_so(tmp_path, capsys):
    root = tmp_path / "run" / "checkpoints"
    manager = CheckpointManager(root)
    manager.save(2, _write, {})
    link, elsewhere = _step_link(root, tmp_path, 1)
    before = sorted(p.name for p in elsewhere.iterdir())

    assert ckpt_main(["prune", str(tmp_path / "run"), "--keep", "1"]) == 0

    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"removed the link {link} (its target {elsewhere} is left as it is)"]
    assert not os.path.lexists(link)
    assert sorted(p.name for p in elsewhere.iterdir()) == before  # never followed
    assert sorted(p.name for p in root.iterdir()) == ["global_step_2", "latest"]  # no .tmp-*


def test_a_resave_over_a_linked_step_folder_leaves_its_target_and_no_trash(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    link, elsewhere = _step_link(root, tmp_path, 1)
    before = sorted(p.name for p in elsewhere.iterdir())
    CheckpointManager(root).save(1, _write, {})
    assert not link.is_symlink() and link.is_dir()
    assert sorted(p.name for p in elsewhere.iterdir()) == before
    assert sorted(p.name for p in root.iterdir()) == ["global_step_1", "latest"]
