"""The live display: start-up phases with their times, then the step bar with ETA, loss and KL."""

from __future__ import annotations

import io
import re
import threading
import time

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
        progress.update(11, {**ROW, "timing/step": 30.0})  # the process's first: warming up
        progress.update(12, {**ROW, "policy/kl": 0.002})
    text = _text(console)
    assert "startup: engines" in text and "startup: first weight sync failed" in text
    assert re.search(r"✓ startup: engines\s+0:00:00", text)
    assert "12/100" in text
    assert "ETA 2:56" in text  # 88 steps left at 2 s each: the first step's 30 s left out
    assert "reward 0.250" in text and "loss -0.0123" in text
    assert "kl 0.0020" in text  # the KL penalty, when the run has one


def test_elsewhere_plain_lines_and_the_approximate_kl_without_a_kl_loss():
    console = _console(terminal=False)
    with StepProgress(console=console) as progress:
        with progress.phase("model"):
            pass
        progress.start_steps(3)
        progress.update(1, ROW)
        progress.update(2, {**ROW, "timing/step": 4.0})  # the ETA from the second step on
        progress.update(3, {"reward/mean": 0.5})  # a row without loss or timing
    lines = _text(console).splitlines()
    assert lines[0] == "startup: model ..."
    assert re.fullmatch(r"startup: model ready in \d+\.\ds", lines[1])
    assert lines[2:] == [
        "step 1/3 reward 0.250 loss -0.0123 approx_kl 0.0004 2.00s/step ETA -",
        "step 2/3 reward 0.250 loss -0.0123 approx_kl 0.0004 4.00s/step ETA 0:04",
        "step 3/3 reward 0.500 loss - kl - -s/step ETA 0:00",
    ]


def test_the_eta_leaves_out_the_first_step_and_is_not_moved_by_one_slow_step():
    console = _console(terminal=False)
    with StepProgress(console=console) as progress:
        progress.start_steps(200)
        for step, seconds in enumerate([2.4, 0.1, 0.1, 3.0, 0.1], start=1):
            progress.update(step, {**ROW, "timing/step": seconds})
    etas = [line.rsplit("ETA ", 1)[1] for line in _text(console).splitlines()]
    # steps 2-5: 198..195 steps left at the median 0.1 s (a mean would say 3:29 after step 4)
    assert etas == ["-", "0:20", "0:20", "0:20", "0:20"]


def test_elsewhere_a_long_phase_says_it_still_runs(monkeypatch):
    """A log shows no clock: a phase (a vLLM server's start: a minute) says it is still going."""
    monkeypatch.setattr("trainer.metrics._logger.STILL_EVERY_S", 0.05)
    console = _console(terminal=False)
    with StepProgress(console=console) as progress:
        with progress.phase("engines"):
            deadline = time.monotonic() + 60  # a busy machine may be slow to run the thread
            while "so far" not in _text(console) and time.monotonic() < deadline:
                time.sleep(0.01)
        monkeypatch.setattr("trainer.metrics._logger.STILL_EVERY_S", 3600.0)
        with progress.phase("workers"):
            pass
    lines = _text(console).splitlines()
    assert lines[0] == "startup: engines ..."
    assert re.fullmatch(r"startup: engines \.\.\. \d+s so far", lines[1])
    assert lines[-1].startswith("startup: workers ready in")
    assert not any("workers ... " in line and "so far" in line for line in lines)
    assert not [t for t in threading.enumerate() if t.name.startswith("startup ")]


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
        "step 1/2 reward 0.250 loss -0.0123 grad_norm 0.8123 2.00s/step ETA -",
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

    assert load_config(None, overrides).plan.one_update_per_batch is one


EVAL = {
    "eval/reward_mean": 0.8,
    "eval/sampled_reward_mean": 0.53125,
    "eval/num_prompts": 20.0,
    "timing/eval": 23.4,
}


@pytest.mark.parametrize("terminal", [False, True])
def test_an_eval_is_shown_while_it_runs_and_its_result_stays_on_the_console(terminal):
    console = _console(terminal=terminal)
    with StepProgress(console=console) as progress:
        progress.start_steps(10)
        with progress.evaluating(5) as shown:
            shown |= EVAL
        progress.update(6, ROW)
    text = _text(console)
    result = "eval at step 5: greedy reward 0.800, sampled 0.531 (20 prompts)"
    if terminal:
        assert re.search(rf"✓ {re.escape(result)}\s+0:00:00", text)
    else:  # a line when it starts (an eval can take a minute) and one with its result
        assert "eval at step 5 ...\n" in text
        assert f"{result} in 23.4s\n" in text


def test_the_closing_lines_name_the_evals_and_a_restart_the_end_abandoned(capsys):
    from trainer.__main__ import _print_summary

    _print_summary(
        {
            "run_dir": "runs/x",
            "steps": 10.0,
            "reward/first_20pct": 0.1,
            "reward/last_20pct": 0.5,
            "step_time_mean_s": 1.5,
            "eval/first_step": 0.0,
            "eval/first_reward_mean": 0.65,
            "eval/first_sampled_reward_mean": 0.1125,
            "eval/last_step": 10.0,
            "eval/last_reward_mean": 1.0,
            "eval/last_sampled_reward_mean": 0.95,
            "engine_restart_events": [
                {"engine": 0, "step": 2, "cause": "ConnectError", "seconds": 4.2},
                {"engine": 1, "step": 3, "cause": "ConnectError", "seconds": None},
            ],
        }
    )
    err = capsys.readouterr().err
    assert (
        "eval: greedy 0.650, sampled 0.113 at step 0 -> greedy 1.000, sampled 0.950 at step 10"
        in err
    )
    assert "engine 1: its restart (it failed at step 3) was still running when the run ended" in err
    assert "engine 0" not in err  # it served again


def test_a_partial_credit_evals_accuracy_is_shown_beside_its_reward(capsys):
    from trainer.__main__ import _print_summary
    from trainer.metrics import eval_line

    scores = {"eval/reward_mean": 0.5, "eval/accuracy": 0.25, "eval/num_prompts": 8.0}
    sampled = {"eval/sampled_reward_mean": 0.375, "eval/sampled_accuracy": 0.375}
    assert eval_line(scores | sampled) == (
        "greedy reward 0.500 (accuracy 0.250), sampled 0.375 (8 prompts)"
    )
    summary = {"run_dir": "runs/x", "steps": 2.0, "step_time_mean_s": 1.0}
    for which, step in (("first", 0.0), ("last", 2.0)):
        summary |= {f"eval/{which}_step": step, f"eval/{which}_reward_mean": 0.5}
        summary |= {f"eval/{which}_accuracy": step / 8}
    _print_summary(summary)
    err = capsys.readouterr().err
    assert (
        "eval: greedy 0.500 (accuracy 0.000) at step 0 -> greedy 0.500 (accuracy 0.250) at " in err
    )
