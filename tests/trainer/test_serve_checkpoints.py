"""The training service's checkpoint folders, without the SDK: ``tinker://`` paths that would
leave ``serve.checkpoint_dir`` are refused, and saves appear whole or not at all."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from trainer.checkpoint import write_folder_atomically
from trainer.serve._checkpoints import META_FILE, CheckpointStore, TinkerPath


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tinker://../weights/x", "'..' is not a checkpoint name"),
        ("tinker://run/weights/..", "'..' is not a checkpoint name"),
        ("tinker://run/weights/.", "'.' is not a checkpoint name"),
        ("tinker://../../weights/x", "tinker://RUN/weights/NAME paths only"),
        ("tinker://run/sampler_weights/x", "tinker://RUN/weights/NAME paths only"),
        ("tinker://run/weights/a/b", "tinker://RUN/weights/NAME paths only"),
        ("tinker://run/weights/", "'' is not a checkpoint name"),
        ("tinker://run/weights/%2e%2e", "'%2e%2e' is not a checkpoint name"),
        ("/etc/passwd", "is not a tinker:// path"),
        (None, "is not a tinker:// path"),
    ],
)
def test_a_path_that_is_not_one_checkpoint_under_the_root_is_refused(
    path: object, message: str
) -> None:
    with pytest.raises(ValueError) as refused:
        TinkerPath.parse(path)
    assert message in str(refused.value)


def test_a_folder_resolving_outside_the_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "run" / "weights").mkdir(parents=True)
    (root / "run" / "weights" / "out").symlink_to(tmp_path)  # a link planted in the root
    store = CheckpointStore(root)
    with pytest.raises(ValueError, match=r"resolves outside serve\.checkpoint_dir"):
        store.folder(TinkerPath("run", "out"))
    assert store.folder(TinkerPath("run", "in")) == (root / "run" / "weights" / "in").resolve()


def _write(folder: Path) -> None:
    (folder / "adapter.bin").write_bytes(b"w" * 10)


def test_save_list_delete_and_a_failed_save_leaves_nothing(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path)
    path = TinkerPath("run", "a")
    store.save(
        path, {"time": "2026-01-01T00:00:00+00:00", "base_model": "tiny"}, _write, overwrite=False
    )
    folder = tmp_path / "run" / "weights" / "a"
    assert json.loads((folder / META_FILE).read_text())["base_model"] == "tiny"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    with pytest.raises(ValueError, match="tinker://run/weights/a exists"):
        store.save(path, {"time": "t"}, _write, overwrite=False)

    def fails(folder: Path) -> None:
        _write(folder)
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        store.save(TinkerPath("run", "b"), {"time": "t"}, fails, overwrite=False)
    with pytest.raises(OSError, match="disk full"):  # an overwrite that fails keeps the old one
        store.save(path, {"time": "t"}, fails, overwrite=True)
    assert sorted(p.name for p in folder.parent.iterdir()) == ["a"]
    assert json.loads((folder / META_FILE).read_text())["base_model"] == "tiny"
    listed = store.checkpoints("run")
    assert [(c["checkpoint_id"], c["tinker_path"]) for c in listed] == [
        ("weights/a", "tinker://run/weights/a")
    ]
    assert listed[0]["size_bytes"] == 10 + (folder / META_FILE).stat().st_size
    store.delete(path)
    assert store.checkpoints("run") == [] and list(folder.parent.iterdir()) == []
    with pytest.raises(ValueError, match="no checkpoint tinker://run/weights/a"):
        store.delete(path)


def _file(name: str):
    def write(folder: Path) -> None:
        (folder / name).write_text(name)

    return write


def test_an_overwrite_replaces_the_folder_whole(tmp_path: Path) -> None:
    final = tmp_path / "x"
    write_folder_atomically(final, _file("old"))
    with pytest.raises(FileExistsError):
        write_folder_atomically(final, _file("new"))
    write_folder_atomically(final, _file("new"), overwrite=True)
    assert [p.name for p in final.iterdir()] == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["x"]
