"""Ctrl-C cancels the run's block, says where it was, and a second Ctrl-C kills at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import trio

from tests.e2e.helpers import REPO  # the checkout, where `-c` scripts import trainer from
from trainer.debug import task_tree, where_line
from trainer.run._interrupt import stop_on_interrupt
from trainer.vocabulary import Timer, operation, step_deadline


def _where() -> str:
    return where_line({"tasks": task_tree()})


async def test_ctrl_c_cancels_the_block_and_raises_keyboard_interrupt_saying_where():
    handler_while_stopping = []

    async def step() -> None:
        with step_deadline(3, None), Timer("generate"), operation("generate"):
            try:
                os.kill(os.getpid(), signal.SIGINT)
                await trio.sleep_forever()
            finally:
                handler_while_stopping.append(signal.getsignal(signal.SIGINT))

    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as info:
        async with stop_on_interrupt(_where, grace_s=600):
            await step()
    message = str(info.value)
    assert message.startswith(
        "interrupted at step 3 (stage='generate', operation='generate'); stopped in "
    )
    assert handler_while_stopping == [signal.SIG_DFL]  # a second Ctrl-C would have killed
    assert signal.getsignal(signal.SIGINT) is before


async def test_without_ctrl_c_the_blocks_own_outcome_passes_through():
    async with stop_on_interrupt(_where, grace_s=600):
        await trio.sleep(0.01)
    with pytest.raises(ValueError, match="its own error"):
        async with stop_on_interrupt(_where, grace_s=600):
            raise ValueError("its own error")


STUBBORN = """
import sys
import trio
from trainer.run._interrupt import stop_on_interrupt

async def main():
    async with stop_on_interrupt(lambda: "the stubborn block", grace_s=float(sys.argv[1])):
        with trio.CancelScope(shield=True):
            print("ready", flush=True)
            await trio.sleep(600)

trio.run(main)
"""


def _stubborn(grace_s: float) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN, str(grace_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_a_second_ctrl_c_kills_a_run_that_does_not_stop():
    proc = _stubborn(grace_s=600)
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(1)
        assert proc.poll() is None  # stopping (shielded), not dead
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == -signal.SIGINT
    finally:
        proc.kill()
        proc.communicate()


def test_a_run_still_stopping_after_the_grace_period_is_killed():
    proc = _stubborn(grace_s=2)
    try:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == -signal.SIGINT
    finally:
        proc.kill()
        _, err = proc.communicate()
    assert "the run did not stop within 2s of Ctrl-C: killing it" in err
