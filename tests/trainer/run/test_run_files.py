"""The run's own files are read and written off the trio thread (DESIGN 3 rule 1): the run
directory, ``config.yaml``, ``train.log``, ``metrics.jsonl`` (restored on a resume, then
appended to), ``summary.json``, the checkpoints. A slow or network disk then stalls a
worker thread, never the event loop that serves the rollouts.

An audit hook (``sys.addaudithook``) sees every ``open``, ``mkdir``, ``rename``/``replace``
and ``remove`` the process makes; armed for one run, it records those the trio thread made
under the run directory.
"""

from __future__ import annotations

import os
import stat
import sys
import threading
from pathlib import Path

import pytest

import trainer.run
from tests.trainer.run.test_resume import SMALL
from trainer.__main__ import main as trainer_main
from trainer.config import load_config

_EVENTS = {"open", "os.mkdir", "os.rename", "os.replace", "os.remove", "os.truncate"}


class _OnTheTrioThread:
    """File events on one thread under one directory, while armed."""

    def __init__(self) -> None:
        self.root: str | None = None
        self.thread: int | None = None
        self.seen: list[tuple[str, str]] = []

    def __call__(self, event: str, args: tuple) -> None:
        if self.root is None or event not in _EVENTS or threading.get_ident() != self.thread:
            return
        path = args[0] if args else None
        if isinstance(path, (str, os.PathLike)) and os.path.abspath(path).startswith(self.root):
            self.seen.append((event, os.path.relpath(path, self.root)))


_HOOK = _OnTheTrioThread()
sys.addaudithook(_HOOK)  # a hook cannot be removed: it stays, disarmed, for the process


@pytest.fixture
def trio_thread_file_io(tmp_path: Path):
    _HOOK.root, _HOOK.thread, _HOOK.seen = str(tmp_path.resolve()), threading.get_ident(), []
    try:
        yield _HOOK.seen
    finally:
        _HOOK.root = None


async def test_a_run_and_its_resume_touch_no_file_on_the_trio_thread(tmp_path, trio_thread_file_io):
    run_dir = tmp_path / "run"
    common = [*SMALL, f"trainer.run_dir={run_dir}"]
    await trainer.run.train(load_config(None, [*common, "trainer.max_steps=2"]))
    await trainer.run.train(
        load_config(None, [*common, "trainer.max_steps=3", "trainer.resume_mode=latest"])
    )
    assert (run_dir / "summary.json").exists() and len(list((run_dir / "checkpoints").iterdir()))
    assert trio_thread_file_io == []


async def test_the_hook_sees_a_file_written_on_the_trio_thread(tmp_path, trio_thread_file_io):
    """The check above can fail: the same hook catches a write made where the run's were."""
    (tmp_path / "x").write_text("")
    assert trio_thread_file_io == [("open", "x")]


def _cli_refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """``python -m trainer ARGV`` in this process: its exit status and last stderr line."""
    status = trainer_main(argv)
    return status, capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("override", "error"),
    [
        ("generator.cls=os:system", "ConfigError: config: generator.cls='os:system' is not a"),
        ("trainer.train_batch_size=64", "ConfigError: "),  # data.num_examples=8 prompts
        ("data.train=/nonexistent/train.jsonl", ""),
    ],
)
def test_a_run_refused_at_start_writes_nothing(tmp_path, monkeypatch, capsys, override, error):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    argv = [*SMALL, "data.num_examples=8", f"trainer.run_dir={run_dir}", override]
    status, last = _cli_refusal(argv, capsys)
    assert status == 2 and last.startswith(error) and last.split(":")[0].endswith("Error")
    assert not run_dir.exists()
    assert list(tmp_path.iterdir()) == []  # no runs/, no train.log, no config.yaml anywhere


async def test_a_run_dir_and_what_a_run_writes_in_it_are_the_users_alone(tmp_path):
    run_dir = tmp_path / "runs" / "private"
    await trainer.run.train(
        load_config(None, [*SMALL, f"trainer.run_dir={run_dir}", "trainer.max_steps=1"])
    )
    modes = {
        str(p.relative_to(run_dir)): stat.S_IMODE(p.lstat().st_mode) for p in run_dir.rglob("*")
    }
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    for name in ("train.log", "metrics.jsonl"):
        assert modes[name] == 0o600, name
    checkpoint = {k: m for k, m in modes.items() if k.startswith("checkpoints/")}
    assert "checkpoints/global_step_1/trainer_state.json" in checkpoint
    for name, mode in checkpoint.items():
        expected = 0o700 if (run_dir / name).is_dir() else 0o600
        assert mode == expected, f"{name}: {mode:04o}"
