"""Reward functions that misbehave for real, for the reward-worker tests: imported by path in
the workers (``data.reward_fn=tests.trainer.data.rewards:NAME``)."""

from __future__ import annotations

import os
import signal
import subprocess
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


def hostile(response: str, answer: str) -> float:
    """What a careless or hostile reward does, by ``response``: ``alloc`` 10 GB (not touched:
    without a limit it succeeds, harmless); ``fork`` leave three sleepers (one in the worker's
    group, one in a session of its own, one forked) and hang; ``exit`` ``os._exit(3)``;
    ``close`` close every descriptor, the worker's reply pipe included. Anything else: 1.0
    when it equals ``answer``."""
    if response == "alloc":
        blob = bytearray(10 << 30)
        return float(len(blob) > 0)
    if response == "fork":
        subprocess.Popen(["sleep", "600"])
        subprocess.Popen(["sleep", "600"], start_new_session=True)
        if os.fork() == 0:
            time.sleep(600)
            os._exit(0)
        time.sleep(1e6)
    if response == "exit":
        os._exit(3)
    if response == "close":
        os.closerange(0, 1024)
        return 1.0
    return float(response == answer)
