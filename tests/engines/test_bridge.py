"""engines.bridge against real asyncio libraries: aiohttp (client and server), httpx on anyio."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import httpx
import pytest
import trio
from aiohttp import web

from engines.bridge import open_bridge
from trainer.errors import StepTimeoutError
from trainer.vocabulary import step_deadline


async def start_server(handler_cancelled: list[bool]) -> tuple[str, web.AppRunner]:
    """An aiohttp server (asyncio): /fast answers, /slow takes 60 s."""

    async def fast(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def slow(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            handler_cancelled.append(True)
            raise
        return web.Response(text="late")

    app = web.Application()
    app.add_routes([web.get("/fast", fast), web.get("/slow", slow)])
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return f"http://127.0.0.1:{port}", runner


async def test_a_step_deadline_cancels_the_asyncio_request_mid_flight() -> None:
    client_tasks: list[asyncio.Task[object]] = []
    client_cancelled: list[bool] = []
    handler_cancelled: list[bool] = []

    async def fetch(url: str) -> str:
        client_tasks.append(asyncio.current_task())  # type: ignore[arg-type]
        async with aiohttp.ClientSession() as session:
            try:
                async with session.get(url) as response:
                    return await response.text()
            except asyncio.CancelledError:
                client_cancelled.append(True)
                raise

    async with open_bridge() as bridge:
        url, runner = await bridge.run(start_server, handler_cancelled)
        try:
            assert await bridge.run(fetch, f"{url}/fast") == "ok"
            # generous: the request must reach the handler (which takes 60 s) before it expires
            with pytest.raises(StepTimeoutError) as info, step_deadline(3, 5.0):
                await bridge.run(fetch, f"{url}/slow")
            assert info.value.step == 3
            assert client_cancelled == [True]
            assert client_tasks[-1].cancelled()
            # the server side sees the client go away and cancels its handler too
            with trio.fail_after(10):
                while not handler_cancelled:  # noqa: ASYNC110 - set by asyncio code
                    await trio.sleep(0.02)
        finally:
            await bridge.run(runner.cleanup)


async def test_iterating_an_asyncio_generator_and_leaving_early_closes_it_in_asyncio() -> None:
    closed_in_asyncio: list[bool] = []

    async def numbers() -> AsyncIterator[int]:
        try:
            for i in range(100):
                await asyncio.sleep(0)
                yield i
        finally:
            closed_in_asyncio.append(asyncio.current_task() is not None)

    async with open_bridge() as bridge:
        seen = []
        async with bridge.iterate(numbers()) as items:
            async for n in items:
                seen.append(n)
                if n == 2:
                    break
        assert seen == [0, 1, 2]
        assert closed_in_asyncio == [True]

        async with bridge.iterate(numbers()) as items:
            full = [n async for n in items]
        assert full == list(range(100))


async def test_a_deadline_cancels_a_pending_next_item() -> None:
    cancelled: list[bool] = []

    async def stalls() -> AsyncIterator[int]:
        yield 1
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        yield 2

    async with open_bridge() as bridge:
        seen = []
        with trio.move_on_after(0.3) as scope:
            async with bridge.iterate(stalls()) as items:
                async for n in items:
                    seen.append(n)
        assert scope.cancelled_caught
        assert seen == [1]
        assert cancelled == [True]


async def test_run_in_executor_takes_an_executor_of_the_librarys_own() -> None:
    """vLLM's ``AsyncLLM.pause_generation`` runs a job on its own ``ThreadPoolExecutor``
    (trio-asyncio's loop alone takes only a ``TrioExecutor``)."""
    seen: list[str] = []

    def job(x: int) -> int:
        seen.append(threading.current_thread().name)
        return x + 1

    async def library() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(1, thread_name_prefix="library") as pool:
            theirs = await loop.run_in_executor(pool, job, 1)
        return theirs, await loop.run_in_executor(None, job, 2)  # the loop's own, as before

    async with open_bridge() as bridge:
        assert await bridge.run(library) == (2, 3)
    assert seen[0].startswith("library")


async def test_the_bridge_refuses_calls_after_its_block() -> None:
    async def nothing() -> None:
        return None

    async with open_bridge() as bridge:
        await bridge.run(nothing)
    with pytest.raises(RuntimeError, match="closed"):
        await bridge.run(nothing)


async def test_httpx_runs_on_anyio_inside_the_bridge() -> None:
    # httpx under asyncio connects with anyio's asyncio backend, which pytest's anyio plugin
    # imported before trio-asyncio patched asyncio.get_running_loop
    handler_cancelled: list[bool] = []
    async with open_bridge() as bridge:
        url, runner = await bridge.run(start_server, handler_cancelled)
        try:

            async def fetch() -> str:
                async with httpx.AsyncClient() as client:
                    return (await client.get(f"{url}/fast")).text

            assert await bridge.run(fetch) == "ok"
        finally:
            await bridge.run(runner.cleanup)


def test_anyio_imported_before_the_bridge_still_finds_the_loop() -> None:
    script = """
import anyio._backends._asyncio  # binds asyncio.get_running_loop before trio-asyncio patches it
import anyio, trio
from engines.bridge import open_bridge

async def main():
    async def now():
        return anyio.current_time()  # asyncio.get_running_loop().time() in anyio
    async with open_bridge() as bridge:
        print(await bridge.run(now) > 0)

trio.run(main)
"""
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=root, capture_output=True, text=True, timeout=120
    )
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]
