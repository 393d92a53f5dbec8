"""A pool of reward worker processes the run owns (``data.reward_workers``).

Each worker is ``python -m trainer.data._reward_worker SPEC MAX_MEMORY_MB``
(:mod:`trainer.data._reward_worker`) in its own session, spoken to over pipes with trio
streams: nothing here blocks the event loop, and no thread waits on a process.
:func:`open_reward_pool` starts the workers and returns once each has imported the reward
function; leaving it kills every worker (and anything a worker started:
:func:`~trainer.data._reward_reaper.kill_worker_tree`, its group, its session and its token)
and reaps it, so nothing is left behind whether the run ends, fails or is cancelled.

A worker never outlives the trainer: it is started by :func:`engines.launch.open_child`, so
the kernel SIGKILLs it when the trainer dies (SIGKILL and crashes included), and its reaper
then kills what it started. Its data segment is limited to ``data.reward_max_memory_mb``.

:meth:`RewardPool.call` takes an idle worker (waiting for one while all are busy) and bounds
the call by its timeout: a call past it, a call cancelled from outside (the step's deadline)
and a worker that died mid-call all kill that worker, and a replacement is started in the
pool's own nursery, so later calls do not pay for its start.
"""

from __future__ import annotations

import math
import os
import pickle
import secrets
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from engines.launch import ChildProcess, open_child
from trainer.data._reward_reaper import WORKER_TOKEN_ENV, kill_worker_tree
from trainer.data._reward_wire import HEADER, frame
from trainer.errors import ConfigError
from trainer.vocabulary import open_owner_nursery

__all__ = ["Outcome", "RewardPool", "open_reward_pool"]

#: ``(kind, value)``: ``("ok", reward)``, ``("error", why)`` (the function raised),
#: ``("timeout", why)`` or ``("died", why)`` (the worker process ended mid-call).
Outcome = tuple[str, Any]


@attrs.define(eq=False)
class _Worker:
    process: ChildProcess
    #: ``TRAINER_REWARD_WORKER`` of this worker and of what it starts.
    token: str
    buffer: bytearray = attrs.field(factory=bytearray)
    killed: bool = False

    async def send(self, message: object) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(frame(message))

    async def receive(self) -> Any | None:
        """The next message, or None when the process closed its end (it died)."""
        assert self.process.stdout is not None
        while True:
            if len(self.buffer) >= HEADER.size:
                (n,) = HEADER.unpack_from(self.buffer)
                if len(self.buffer) >= HEADER.size + n:
                    data = bytes(self.buffer[HEADER.size : HEADER.size + n])
                    del self.buffer[: HEADER.size + n]
                    return pickle.loads(data)
            chunk = await self.process.stdout.receive_some(1 << 16)
            if not chunk:
                return None
            self.buffer += chunk

    async def kill(self) -> None:
        """SIGKILL it and all it started (its group, its session, its token), reap it, close
        the pipes; shielded, idempotent."""
        with trio.CancelScope(shield=True):
            if not self.killed:
                self.killed = True
                await trio.to_thread.run_sync(kill_worker_tree, self.process.pid, self.token)
            await self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None:
                    await stream.aclose()


@attrs.define(eq=False)
class RewardPool:
    """Worker processes that run the reward function ``spec`` (see the module doc)."""

    #: The reward function, as the worker imports it (``module:function`` or a built-in name).
    spec: str
    _nursery: trio.Nursery
    #: ``data.reward_max_memory_mb`` of each worker (0: no limit of its own).
    max_memory_mb: int = 0
    _workers: set[_Worker] = attrs.field(factory=set)
    _idle: list[_Worker] = attrs.field(factory=list)
    _ready: trio.Condition = attrs.field(factory=trio.Condition)
    _closing: bool = False

    async def start_worker(self) -> None:
        """Start one worker; it joins the idle ones once it has loaded the reward function."""
        token = secrets.token_hex(8)
        argv = [sys.executable, "-m", "trainer.data._reward_worker", self.spec]
        process = await open_child(
            [*argv, str(self.max_memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # its own session and group: killed with what it starts
            env={
                **os.environ,
                # the modules this process imports, wherever they came from (a checkout, tests)
                "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
                WORKER_TOKEN_ENV: token,
            },
        )
        worker = _Worker(process, token)
        self._workers.add(worker)
        try:
            hello = await worker.receive()
        except BaseException:
            await self._discard(worker)
            raise
        if hello != ("ready",):
            await self._discard(worker)
            why = hello[1] if isinstance(hello, tuple) and len(hello) == 2 else "it exited"
            raise ConfigError(
                f"config: data.reward_fn={self.spec!r}: a reward worker process could not load "
                f"it: {why}"
            )
        async with self._ready:
            self._idle.append(worker)
            self._ready.notify()

    async def _discard(self, worker: _Worker) -> None:
        self._workers.discard(worker)
        await worker.kill()

    async def call(
        self, request: tuple[str, str, dict[str, Any]], timeout_s: float | None
    ) -> Outcome:
        """Run ``request`` (``response, answer, extra``) in a worker, bounded by ``timeout_s``.

        Waiting for an idle worker is not part of the bound (the step's deadline bounds it).
        """
        async with self._ready:
            while not self._idle:
                await self._ready.wait()
            worker = self._idle.pop()
        reply = None
        try:
            with trio.move_on_after(math.inf if timeout_s is None else timeout_s):
                await worker.send(request)
                reply = await worker.receive()
                if reply is None:
                    code = await worker.process.wait()
                    return "died", f"its worker process died (exit code {code}) mid-call"
                return reply
            return "timeout", f"it ran past data.reward_timeout_s={timeout_s:g}s (worker killed)"
        finally:
            if reply is not None:  # answered: the worker is healthy
                async with self._ready:
                    self._idle.append(worker)
                    self._ready.notify()
            else:  # timed out, died or cancelled mid-call: its state is unknown
                await self._discard(worker)
                if not self._closing:
                    self._nursery.start_soon(self.start_worker)

    async def aclose(self) -> None:
        """Kill and reap every worker; calls still waiting for one are left to be cancelled."""
        self._closing = True
        with trio.CancelScope(shield=True):
            for worker in list(self._workers):
                await self._discard(worker)


@asynccontextmanager
async def open_reward_pool(
    spec: str, size: int, max_memory_mb: int | None = None
) -> AsyncIterator[RewardPool]:
    """``size`` workers for ``spec``, each ready and limited to ``max_memory_mb`` MiB of data
    (None: no limit of its own); on exit every one is killed and reaped.

    ConfigError when a worker cannot import the reward function.
    """
    async with open_owner_nursery() as nursery:
        pool = RewardPool(spec, nursery, max_memory_mb or 0)
        try:
            async with open_owner_nursery() as starting:
                for _ in range(size):
                    starting.start_soon(pool.start_worker)
            yield pool
        finally:
            nursery.cancel_scope.cancel()  # replacements still starting
            await pool.aclose()
