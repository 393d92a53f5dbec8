"""The numbers the docs quote come from a recorded run, and the program still prints them.

``docs/record_runs.py`` runs the documented commands and keeps what they printed in
``docs/measured_runs.json``; the docs' MEASURED blocks are rendered from it. Re-record on an
idle machine after a change that moves a number (``.venv/bin/python docs/record_runs.py``).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RERECORD = "re-record them on an idle machine: .venv/bin/python docs/record_runs.py"


def _record_runs():
    spec = importlib.util.spec_from_file_location("record_runs", ROOT / "docs" / "record_runs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


record_runs = _record_runs()
RECORD = json.loads(record_runs.RECORD.read_text())
#: What a step line says that does not depend on the machine: all but its step time and ETA.
STEP_LINE = re.compile(r"^(step \d+/\d+ reward \S+ loss \S+ \S+ \S+) \S+s/step ETA \S+$")


def test_every_measured_block_is_rendered_from_the_record():
    for path, text in record_runs.rendered_docs(RECORD).items():
        assert path.read_text() == text, f"{path.name} is not what {RERECORD} writes"
    for path in record_runs.DOCS.values():
        assert "<!-- BEGIN MEASURED:" in path.read_text(), path


def test_no_doc_quotes_the_default_runs_reward_outside_its_block():
    summary = RECORD["runs"]["default"]["stderr"][-1]
    last = re.findall(r"\d+\.\d+", summary)[1]
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = record_runs.BLOCK.sub("", path.read_text())
        assert "mean reward: first 20% of steps" not in text, f"{path}: quote the record instead"
        assert f"last 20% {last}" not in text, path


@pytest.mark.slow
def test_the_quickstart_run_prints_the_recorded_rewards_and_losses(tmp_path):
    command = RECORD["runs"]["first"]["command"].split()
    assert command[:3] == [".venv/bin/python", "-m", "trainer"]
    argv = [arg for arg in command[3:] if not arg.startswith("trainer.run_dir=")]
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", *argv, f"trainer.run_dir={tmp_path}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    def steps(lines: list[str]) -> list[str]:
        return [m[1] for m in map(STEP_LINE.match, lines) if m]

    recorded = steps(RECORD["runs"]["first"]["stderr"])
    assert len(recorded) == 2
    assert steps(proc.stderr.splitlines()) == recorded, f"the numbers moved: {RERECORD}"
