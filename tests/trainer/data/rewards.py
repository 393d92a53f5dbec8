"""Reward functions that misbehave for real, for the reward-worker tests: imported by path in
the workers (``data.reward_fn=tests.trainer.data.rewards:NAME``)."""

from __future__ import annotations

import os
import signal
import time

import trio


def misbehaving(response: str, answer: str) -> float:
    """What ``response`` says: ``sleep`` forever, ``burn`` CPU forever, ``kill`` its own
    process, ``raise``; anything else scores 1.0 when it equals ``answer``."""
    if response == "sleep":
        time.sleep(1e6)
    if response == "burn":
        while True:
            pass
    if response == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if response == "raise":
        raise ZeroDivisionError("the reward divided by zero")
    return float(response == answer)


async def judge(response: str, answer: str) -> float:
    """An async judge: ``hang`` never answers (a server that never replies), else exact match."""
    if response == "hang":
        await trio.sleep_forever()
    if response == "raise":
        raise ConnectionError("the judge refused the connection")
    return float(response == answer)
