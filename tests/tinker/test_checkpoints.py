"""save_state / load_state through the SDK: a checkpoint resumed with its optimizer, in the
same service or in a new service process on the same folder, continues exactly as the client
that never stopped; tinker:// paths stay inside serve.checkpoint_dir; the checkpoint routes
(list, delete, weights_info, training_runs) answer in the SDK's types."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.tinker.conftest import open_service


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved(workdir: Path) -> Iterator[dict]:
    with open_service(workdir) as service:
        yield service.sdk("ckpt_save")


def test_load_state_with_optimizer_continues_exactly(saved: dict) -> None:
    assert saved["first"]["losses"][1] < saved["first"]["losses"][0]
    # the same client, back at the checkpoint: the same two steps, bit for bit
    assert saved["reloaded"] == saved["uninterrupted"]


def test_a_new_service_process_resumes_the_checkpoint_exactly(saved: dict, workdir: Path) -> None:
    with open_service(workdir) as fresh:
        resumed = fresh.sdk("ckpt_resume", saved["path"])
    assert resumed["model_id"].endswith(":train:0")
    assert resumed["resumed"] == saved["uninterrupted"]


def test_checkpoints_are_folders_under_the_root_and_listed(saved: dict, workdir: Path) -> None:
    run = saved["model_id"]
    assert saved["path"] == f"tinker://{run}/weights/mid"
    folder = workdir / "checkpoints" / run / "weights" / "mid"
    assert (folder / "tinker_checkpoint.json").is_file()
    assert (folder / "optimizer.pt").is_file()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".tmp-")]
    assert saved["listed"] == [
        ["weights/mid", saved["path"], {"note": "after 2 steps"}],
        ["weights/scratch", f"tinker://{run}/weights/scratch", None],
    ]
    assert saved["after_delete"] == ["weights/mid"]
    assert not (folder.parent / "scratch").exists()
    assert saved["info"] == {"base_model": "tiny", "lora_rank": 4}
    assert run in saved["runs"]
    assert saved["run"] == {"base_model": "tiny", "lora_rank": 4, "last_checkpoint": saved["path"]}


def test_paths_that_leave_the_root_or_exist_are_refused(saved: dict) -> None:
    assert (
        "weights/mid exists: save under another name or with overwrite"
        in (saved["save_again"]["message"])
    )
    assert "'..' is not a checkpoint name" in saved["escape"]["message"]
    assert "tinker://RUN/weights/NAME paths only" in saved["escape_deeper"]["message"]
    assert "'..' is not a checkpoint name" in saved["escape_dots"]["message"]
    assert "no checkpoint" in saved["missing"]["message"]
    for refused in ("save_again", "escape", "escape_deeper", "escape_dots", "missing"):
        assert saved[refused].get("category", "user") == "user", refused
