"""Process-group init: real gloo groups, a real rank that never joins, a bound on the controller.

The blocked rank runs in a child process so the test can kill it and see it gone.
"""

from __future__ import annotations

import concurrent.futures
import contextvars
import functools
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import torch
import trio

from engines.process_group import free_port, join_group
from sync.group import init_group
from trainer.errors import CheckpointEngineInitError, FaultInjected
from trainer.vocabulary import install_faults

_CHILD = """
import sys
from engines.process_group import join_group
print("starting", flush=True)
join_group("weights", master_address="127.0.0.1", master_port=int(sys.argv[1]), rank=0,
           world_size=2, store_timeout_s=600)
print("joined", flush=True)
"""


def join_in_thread(fn: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    """Start blocking ``fn`` in a daemon thread now; return an async wait for its result.

    The wait is a bounded wait on the thread's future (abandoned if the controller gives
    up), never a timeout inside the thread. The thread carries the caller's context
    (step, stage, operation), so faults fire on the right step.
    """
    future: concurrent.futures.Future[Any] = concurrent.futures.Future()
    ctx = contextvars.copy_context()

    def run() -> None:
        try:
            future.set_result(ctx.run(fn))
        except BaseException as exc:  # handed to the waiter, re-raised there unchanged
            future.set_exception(exc)

    threading.Thread(target=run, name="init_process_group:join", daemon=True).start()

    async def wait() -> Any:
        return await trio.to_thread.run_sync(future.result, abandon_on_cancel=True)

    return wait


def _thread_join(port: int, rank: int, world_size: int = 2, store_timeout_s: float = 30.0):
    return join_in_thread(
        lambda: join_group(
            "weights",
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=world_size,
            store_timeout_s=store_timeout_s,
        )
    )


async def _broadcast_works(handles) -> None:
    sent = torch.arange(6.0)
    received = torch.zeros(6)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, handles[0].broadcast, sent)
        nursery.start_soon(trio.to_thread.run_sync, handles[1].broadcast, received)
    assert torch.equal(received, sent)


async def test_group_init_completes_within_the_timeout_and_the_group_broadcasts():
    port = free_port()
    handles = await init_group(
        "weights", [_thread_join(port, 0), _thread_join(port, 1)], timeout_s=60
    )
    assert [h.rank for h in handles] == [0, 1]
    await _broadcast_works(handles)
    await _broadcast_works(handles)  # built once, reused


async def test_a_rank_that_never_joins_fails_fast_and_leaves_nothing_blocked():
    port = free_port()
    spawn = functools.partial(
        subprocess.Popen,
        [sys.executable, "-c", _CHILD, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = await trio.to_thread.run_sync(spawn)
    try:
        assert child.stdout is not None
        line = await trio.to_thread.run_sync(child.stdout.readline)
        assert line.strip() == "starting"

        async def child_joined() -> None:
            assert child.stdout is not None
            while (
                await trio.to_thread.run_sync(child.stdout.readline, abandon_on_cancel=True)
            ).strip() != "joined":
                pass

        t0 = time.monotonic()
        with pytest.raises(CheckpointEngineInitError) as info:
            await init_group("weights", [child_joined], timeout_s=1.5)
        assert 1.5 <= time.monotonic() - t0 < 30
        assert info.value.group == "weights" and info.value.timeout_s == 1.5
        assert "sync.group_init_timeout_s" in str(info.value)
        assert child.poll() is None  # rank 0 really is blocked waiting for rank 1
    finally:
        child.kill()
        child.wait(timeout=30)
        assert child.stdout is not None
        child.stdout.close()
    assert child.returncode is not None
    # a fresh init builds a fresh group
    port = free_port()
    handles = await init_group(
        "weights", [_thread_join(port, 0), _thread_join(port, 1)], timeout_s=60
    )
    await _broadcast_works(handles)


async def test_a_thread_rank_the_controller_gave_up_on_ends_at_its_backstop():
    port = free_port()
    before = {t for t in threading.enumerate() if t.name == "init_process_group:join"}
    with pytest.raises(CheckpointEngineInitError):
        await init_group("weights", [_thread_join(port, 0, store_timeout_s=2.0)], timeout_s=0.3)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        left = {t for t in threading.enumerate() if t.name == "init_process_group:join"} - before
        if not left:
            break
        await trio.sleep(0.1)
    assert not left


async def test_the_inits_own_error_is_reraised_unchanged():
    install_faults("init_process_group:error=no route to the engine")
    with pytest.raises(FaultInjected) as info:
        await init_group("weights", [_thread_join(free_port(), 0)], timeout_s=30)
    assert info.value.operation == "init_process_group"
    original = ValueError("bad master address")

    async def failing() -> None:
        raise original

    with pytest.raises(ValueError) as info2:
        await init_group("weights", [failing], timeout_s=30)
    assert info2.value is original
