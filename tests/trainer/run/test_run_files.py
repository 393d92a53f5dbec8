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
import sys
import threading
from pathlib import Path

import pytest

import trainer.run
from tests.trainer.run.test_resume import SMALL
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
