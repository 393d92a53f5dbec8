"""The live display: start-up phases with their times, then the step bar with ETA, loss and KL."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from trainer.metrics import StepProgress


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=160, color_system=None)


def _text(console: Console) -> str:
    out = console.file.getvalue()  # type: ignore[attr-defined]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out)  # cursor moves of the live display


ROW = {"reward/mean": 0.25, "policy/loss": -0.0123, "policy/approx_kl": 0.0004, "timing/step": 2.0}


def test_a_terminal_shows_each_phase_with_its_time_then_the_bar_with_eta_loss_and_kl():
    console = _console(terminal=True)
    with StepProgress(console=console) as progress:
        with progress.phase("engines"):
            pass
        with pytest.raises(RuntimeError), progress.phase("first weight sync"):
            raise RuntimeError("boom")
        progress.start_steps(100, start=10)
        progress.update(11, {**ROW, "policy/kl": 0.002})
    text = _text(console)
    assert "startup: engines" in text and "startup: first weight sync failed" in text
    assert re.search(r"✓ startup: engines\s+0:00:00", text)
    assert "11/100" in text
    assert "ETA 2:58" in text  # 89 steps left at 2 s each
    assert "reward 0.250" in text and "loss -0.0123" in text
    assert "kl 0.0020" in text  # the KL penalty, when the run has one


def test_elsewhere_plain_lines_and_the_approximate_kl_without_a_kl_loss():
    console = _console(terminal=False)
    with StepProgress(console=console) as progress:
        with progress.phase("model"):
            pass
        progress.start_steps(3)
        progress.update(1, ROW)
        progress.update(2, {**ROW, "timing/step": 4.0})  # the ETA follows the mean step time
        progress.update(3, {"reward/mean": 0.5})  # a row without loss or timing
    lines = _text(console).splitlines()
    assert lines[0] == "startup: model ..."
    assert re.fullmatch(r"startup: model ready in \d+\.\ds", lines[1])
    assert lines[2:] == [
        "step 1/3 reward 0.250 loss -0.0123 approx_kl 0.0004 2.00s/step ETA 0:04",
        "step 2/3 reward 0.250 loss -0.0123 approx_kl 0.0004 4.00s/step ETA 0:03",
        "step 3/3 reward 0.500 loss - kl - -s/step ETA 0:00",
    ]


def test_disabled_it_prints_nothing():
    console = _console(terminal=False)
    with StepProgress(enabled=False, console=console) as progress:
        with progress.phase("model"):
            pass
        progress.start_steps(1)
        progress.update(1, ROW)
    assert _text(console) == ""


def test_with_one_update_per_batch_the_bar_shows_the_grad_norm_not_a_zero_approx_kl():
    console = _console(terminal=False)
    with StepProgress(console=console, one_update_per_batch=True) as progress:
        progress.start_steps(2)
        progress.update(1, {**ROW, "policy/approx_kl": 0.0, "policy/grad_norm": 0.8123})
        progress.update(2, {**ROW, "policy/kl": 0.002, "policy/grad_norm": 0.5})
    assert _text(console).splitlines() == [
        "step 1/2 reward 0.250 loss -0.0123 grad_norm 0.8123 2.00s/step ETA 0:02",
        "step 2/2 reward 0.250 loss -0.0123 kl 0.0020 2.00s/step ETA 0:00",  # a KL penalty first
    ]


@pytest.mark.parametrize(
    ("overrides", "one"),
    [
        ([], True),
        (["trainer.update_epochs=2"], False),
        (["trainer.policy_mini_batch_size=8"], False),
        (["trainer.policy_mini_batch_size=16"], True),
    ],
)
def test_one_update_per_batch_is_the_default_and_what_changes_it(overrides, one):
    from trainer.config import load_config
    from trainer.loop import one_update_per_batch

    assert one_update_per_batch(load_config(None, overrides)) is one
