"""A failed run's stderr ends with the one-line typed error and where its traceback is."""

from __future__ import annotations

import pytest

from tests.e2e.helpers import last_stderr_line, run_trainer
from trainer.__main__ import _fail
from trainer.errors import FaultInjected

pytestmark = pytest.mark.slow

FAILING = (
    "engine.backend=inprocess",
    "trainer.max_steps=2",
    "faults=forward_backward:error=boom@2",
)
ERROR = "FaultInjected: fault injected in 'forward_backward' at step 2: boom"


def test_a_failed_run_keeps_its_traceback_in_train_log_and_off_stderr(tmp_path):
    proc = run_trainer(*FAILING, f"trainer.run_dir={tmp_path}")
    assert proc.returncode == 1
    assert last_stderr_line(proc) == ERROR
    lines = proc.stderr.rstrip("\n").splitlines()
    log = tmp_path / "train.log"
    assert lines[-2] == f"the traceback is in {log} (--verbose prints it here)"
    assert "Traceback (most recent call last)" not in proc.stderr
    logged = log.read_text()
    assert "Traceback (most recent call last)" in logged and "boom" in logged


def test_verbose_prints_the_traceback_before_the_one_line(tmp_path):
    proc = run_trainer("--verbose", *FAILING, f"trainer.run_dir={tmp_path}")
    assert proc.returncode == 1
    assert last_stderr_line(proc) == ERROR
    head, _, _ = proc.stderr.rpartition(ERROR)
    assert "Traceback (most recent call last)" in head


def test_an_error_with_no_log_to_hold_it_prints_its_traceback(tmp_path, capsys):
    try:
        raise FaultInjected("forward_backward", "boom", 2)
    except FaultInjected as exc:
        exc.add_note("cleanup '/resume' skipped")
        assert _fail(exc, code=1, show_traceback=False, log_file=tmp_path / "train.log") == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert err.rstrip("\n").splitlines()[-1].startswith("FaultInjected: ")


def test_the_notes_of_a_logged_error_come_before_the_one_line(tmp_path, capsys):
    log = tmp_path / "train.log"
    log.write_text("the run's log\n")
    exc = FaultInjected("forward_backward", "boom", 2)
    exc.add_note("cleanup '/resume' skipped")
    _fail(exc, code=1, show_traceback=False, log_file=log)
    assert capsys.readouterr().err.splitlines() == [
        "note: cleanup '/resume' skipped",
        f"the traceback is in {log} (--verbose prints it here)",
        f"FaultInjected: {exc}",
    ]
