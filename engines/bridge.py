"""A trio-asyncio bridge: run asyncio-only libraries (vLLM's ``AsyncLLM``, aiohttp, ...) from trio.

::

    async with open_bridge() as bridge:                  # an asyncio loop in this nursery
        body = await bridge.run(fetch, session, url)      # an asyncio coroutine function
        async with bridge.iterate(stream()) as chunks:    # an asyncio async iterator
            async for chunk in chunks:
                ...

The asyncio loop is trio-asyncio's loop on top of trio, owned by the ``open_bridge`` block:
it starts when the block is entered and is closed (its remaining asyncio tasks cancelled)
when the block exits. Every call runs as an asyncio task on that loop; **trio cancellation
reaches it**: when the caller's cancel scope fires (a step deadline, a nursery failing) the
asyncio task is cancelled (``asyncio.CancelledError`` is thrown into it) and the trio caller
gets ``trio.Cancelled`` once the task has unwound, so an asyncio library's own cleanup (abort
a request, close a connection) runs before the deadline's error propagates.

A bridge may be used from any trio task while its block is open; using it after the block
exits raises ``RuntimeError``.

Import order does not matter: trio-asyncio makes ``asyncio.get_running_loop`` find its loop
by patching it when it is imported, and a module that bound the function before that (anyio's
asyncio backend does, ``from asyncio import get_running_loop``, and pytest's anyio plugin
imports it at start-up) is pointed at the patched one when this module is imported. Without
that, httpx (through httpcore's anyio backend) fails inside the bridge with
``RuntimeError: no running event loop``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from contextlib import asynccontextmanager
from typing import Any, ParamSpec, TypeVar, cast

import trio
import trio_asyncio

__all__ = ["Bridge", "open_bridge"]

T = TypeVar("T")
P = ParamSpec("P")

#: Seconds an abandoned asyncio iterator gets to close (``aclose``) after its consumer leaves.
ITERATOR_CLOSE_TIMEOUT_S = 5.0
_DONE = object()
#: Modules known to bind ``asyncio.get_running_loop`` at import (``from asyncio import ...``).
_EARLY_BINDERS = ("anyio._backends._asyncio",)


def _rebind_get_running_loop() -> None:
    """Point modules that imported ``asyncio.get_running_loop`` before trio-asyncio patched it
    at the patched function (see the module docstring); modules imported later bind it
    themselves."""
    for name in _EARLY_BINDERS:
        module = sys.modules.get(name)
        if module is not None and module.get_running_loop is not asyncio.get_running_loop:
            setattr(module, "get_running_loop", asyncio.get_running_loop)  # noqa: B010


_rebind_get_running_loop()


class Bridge:
    """Calls into one trio-asyncio loop; create with :func:`open_bridge`."""

    def __init__(self, loop: trio_asyncio.TrioEventLoop, closed: trio.Event) -> None:
        """``closed`` is set by the owner (``open_bridge``) when its block exits."""
        #: The asyncio event loop (a ``trio_asyncio.TrioEventLoop``).
        self.loop = loop
        self._closed = closed

    def _check_open(self) -> None:
        if self._closed.is_set() or self.loop.is_closed():
            raise RuntimeError("the bridge's asyncio loop is closed (its open_bridge block exited)")

    async def run(self, fn: Callable[P, Awaitable[T]], *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``await fn(*args, **kwargs)`` as an asyncio task; return or raise its result.

        ``fn`` is called inside the asyncio task (so ``asyncio.get_running_loop()`` works in
        it). If the calling trio scope is cancelled, the task is cancelled and this raises
        ``trio.Cancelled`` after the task has finished unwinding. An ``asyncio.CancelledError``
        the task raises on its own (without a trio cancellation) propagates unchanged.
        """
        self._check_open()

        async def call() -> T:
            return await fn(*args, **kwargs)

        return cast(T, await self.loop.run_aio_coroutine(call()))

    @asynccontextmanager
    async def iterate(self, iterator: AsyncIterator[T]) -> AsyncIterator[AsyncIterator[T]]:
        """Iterate an asyncio async iterator from trio::

            async with bridge.iterate(stream()) as items:
                async for item in items:
                    ...

        Each ``__anext__`` runs as an asyncio task (cancelled with the trio scope, as in
        :meth:`run`). Leaving the block early (``break``, an error, a cancellation) closes
        the iterator on the asyncio loop (``aclose``, shielded, bounded by
        ``ITERATOR_CLOSE_TIMEOUT_S``), so an async generator's ``finally`` runs in asyncio
        before the block exits. (A block, not a bare ``async for``: Python does not close an
        abandoned async generator until it is garbage-collected.)
        """
        self._check_open()
        finished = False

        async def next_item() -> Any:
            try:
                return await iterator.__anext__()
            except StopAsyncIteration:
                return _DONE

        async def items() -> AsyncGenerator[T, None]:
            nonlocal finished
            while True:
                item = await self.loop.run_aio_coroutine(next_item())
                if item is _DONE:
                    finished = True
                    return
                yield cast(T, item)

        gen = items()
        try:
            yield gen
        finally:
            await gen.aclose()  # trio side: nothing to unwind but the generator frame
            aclose = getattr(iterator, "aclose", None)
            if not finished and aclose is not None and not self.loop.is_closed():
                with trio.CancelScope(shield=True), trio.move_on_after(ITERATOR_CLOSE_TIMEOUT_S):
                    await self.loop.run_aio_coroutine(aclose())


def _accept_any_executor(loop: trio_asyncio.TrioEventLoop) -> None:
    """Let ``loop.run_in_executor`` take any ``concurrent.futures.Executor``, as asyncio's does.

    trio-asyncio's takes only its own ``TrioExecutor`` (or None) and asserts otherwise; vLLM's
    ``AsyncLLM`` hands it a ``ThreadPoolExecutor`` of its own (``pause_generation`` clears its
    renderer's cache there). Any other executor gets the job submitted to it and its future
    wrapped for this loop (``asyncio.wrap_future``: the result comes back through
    ``call_soon_threadsafe``, which trio-asyncio's loop has).
    """
    own = loop.run_in_executor

    def run_in_executor(
        executor: Executor | None, func: Callable[..., T], *args: object
    ) -> asyncio.Future[T]:
        if executor is None or isinstance(executor, trio_asyncio.TrioExecutor):
            return own(executor, func, *args)
        return asyncio.wrap_future(executor.submit(func, *args), loop=loop)

    loop.run_in_executor = run_in_executor  # type: ignore[method-assign]


@asynccontextmanager
async def open_bridge() -> AsyncIterator[Bridge]:
    """Open an asyncio loop for the block's life (see the module docstring).

    On exit the loop stops and closes; asyncio tasks still running are cancelled.
    """
    closed = trio.Event()
    async with trio_asyncio.open_loop() as loop:
        _accept_any_executor(loop)
        try:
            yield Bridge(loop, closed)
        finally:
            closed.set()
