"""Real HTTP servers for tests, on hypercorn's trio worker: tiny hand-written ASGI apps for
client tests, the reference ``ServerApp`` in-process (a server of a test's own), and
:class:`BackgroundEngines` (reference servers in their own processes, shared by a module);
and :class:`StepGate`, which holds an in-process engine's decode steps where a test says."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from engines.client import DATA_PLANE_ROUTES, PAUSE_ROUTES, SLEEP_ROUTES
from engines.launch import EngineUrls, launch_local_engines
from engines.local.engine import LocalEngine, open_local_engine
from engines.local.http import answer_lifespan
from engines.local.server import ServerApp

#: Generous: two cores shared with other test runs.
STARTUP_TIMEOUT_S = 180.0

#: (method, path, headers) -> (status, body); may await forever to model a hung server.
Handler = Callable[[str, str, dict[str, str]], Awaitable[tuple[int, Any]]]


def asgi(handler: Handler) -> Callable[..., Awaitable[None]]:
    """An ASGI app answering every HTTP request with ``await handler(method, path, headers)``."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        while (await receive()).get("more_body"):
            pass
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        status, body = await handler(scope["method"], scope["path"], headers)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": raw})

    return app


@asynccontextmanager
async def serve_asgi(app: Callable[..., Awaitable[None]]) -> AsyncIterator[str]:
    """Serve the ASGI ``app`` on 127.0.0.1 (a free port) for the block; yields its base URL."""
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.graceful_timeout = 0.1
    config.accesslog = None
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve, app, config, shutdown_trigger=shutdown.wait))
        try:
            yield binds[0]
        finally:
            shutdown.set()


def serve_app(handler: Handler) -> AbstractAsyncContextManager[str]:
    """Serve ``handler`` (see :func:`asgi`) for the block; yields its base URL."""
    return serve_asgi(asgi(handler))


@asynccontextmanager
async def serve_reference(model_dir: Path, **server_kwargs: Any) -> AsyncIterator[str]:
    """The real reference server (``ServerApp(engine, **server_kwargs)``) in this process,
    for the block: a server of the test's own, far cheaper than a new process."""
    async with serve_reference_engine(model_dir, **server_kwargs) as (url, _):
        yield url


@asynccontextmanager
async def serve_reference_engine(
    model_dir: Path, **server_kwargs: Any
) -> AsyncIterator[tuple[str, LocalEngine]]:
    """:func:`serve_reference`, yielding the served engine too (for a :class:`StepGate`)."""
    async with open_local_engine(model_dir) as engine:
        app = ServerApp(engine, served_model=str(model_dir), **server_kwargs)
        async with serve_asgi(app) as url:
            yield url, engine


def bearer(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of ``api_key`` (None: no header)."""
    return {} if api_key is None else {"Authorization": f"Bearer {api_key}"}


def auth(urls: list[str]) -> dict[str, str]:
    """The header a launcher's servers ask for: ``urls.api_key`` of an
    :class:`~engines.launch.EngineUrls` (a plain list of URLs: none)."""
    return bearer(getattr(urls, "api_key", None))


async def stats(url: str, api_key: str | None = None) -> dict[str, Any]:
    """The reference server's ``GET /engine_stats`` (with ``api_key``, where it asks for one)."""
    async with httpx.AsyncClient(headers=bearer(api_key)) as http:
        return (await http.get(f"{url}/engine_stats")).json()


def steps(s: dict[str, Any]) -> int:
    """Decode steps run so far, from an ``/engine_stats`` answer."""
    return sum(s["batch_size_counts"].values())


class BackgroundEngines:
    """``launch_local_engines`` held open in a background thread until :meth:`stop`.

    pytest-trio runs each test in its own ``trio.run``, so a server shared by a module is
    owned by a thread running its own ``trio.run``; tests talk to it over HTTP.
    """

    def __init__(
        self,
        num_engines: int,
        model_dir: Path,
        log_dir: Path,
        extra_args: tuple[str, ...] = (),
        weight_dir: Path | None = None,
    ) -> None:
        self.urls: EngineUrls = EngineUrls([], "")
        self.log_dir = log_dir
        self.error: BaseException | None = None
        self._args = (num_engines, model_dir, log_dir)
        self._extra_args = extra_args
        #: The folder the servers' disk updates may read (None: they refuse every one).
        self._weight_dir = weight_dir
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=trio.run, args=(self._main,), daemon=True)

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            async with launch_local_engines(
                *self._args,
                startup_timeout_s=STARTUP_TIMEOUT_S,
                extra_args=self._extra_args,
                weight_dir=self._weight_dir,
                # the suite's fork server (tests/conftest.py), where there is one
                fork_server=os.environ.get("TRAINER_FORK_SERVER"),
            ) as urls:
                self.urls = urls
                self._ready.set()
                await self._stop.wait()
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> BackgroundEngines:
        self._thread.start()
        self._ready.wait(STARTUP_TIMEOUT_S + 30)
        if self.error is not None or not self.urls:
            raise RuntimeError(f"engine servers did not start: {self.error!r}")
        return self

    def stop(self) -> None:
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(60)


#: How long a held decode step waits for its release before it runs anyway (a test that
#: failed before releasing it must not leave the engine's thread blocked for ever).
GATE_TIMEOUT_S = 120.0


#: A step to hold: its number (from 1, counted from the gate's install), or a condition read
#: in the engine's thread as each step starts (the first step for which it holds).
Hold = int | Callable[[], bool]


class StepGate:
    """Holds chosen decode steps of an in-process :class:`LocalEngine` until the test releases
    them, so a request is in flight at a known point however fast the engine is.

    ``with StepGate(engine, hold={3}) as gate:`` holds step 3 (steps counted from 1 from the
    install); ``hold={cond}`` holds the first step that starts while ``cond()`` is true (e.g.
    ``lambda: engine.num_running == 4``: all four are in that step's batch). A held step waits
    in the engine's worker thread, under its step lock, before its first forward pass:
    ``await gate.reached(h)`` returns once it waits there, and ``gate.release(h)`` lets it
    run. A ``pause`` that lands meanwhile lets that one step finish (its tokens are kept) and
    no further one start (:meth:`pause_at`). On exit every held step is released and the
    hook removed.

    Public handles only: a forward pre-hook on ``engine.model``, and the engine's step count
    (``batch_size_counts``, incremented on the event loop before each step's thread starts).
    """

    def __init__(self, engine: LocalEngine, hold: Iterable[Hold]) -> None:
        self.engine = engine
        self._reached = {h: trio.Event() for h in hold}
        self._release = {h: threading.Event() for h in self._reached}
        self._held: set[Hold] = set()
        self._held_steps: set[int] = set()
        self._base = 0
        self._hook: Any = None

    def _steps(self) -> int:
        return sum(self.engine.batch_size_counts.values()) - self._base

    def __enter__(self) -> StepGate:
        self._base = self._steps()

        def before_forward(module: Any, args: Any) -> None:
            k = self._steps()  # the step in flight
            if k in self._held_steps:
                return  # its second forward pass (a step may run two)
            for h in self._reached:
                if h not in self._held and (h == k if isinstance(h, int) else h()):
                    self._held.add(h)
                    self._held_steps.add(k)
                    trio.from_thread.run_sync(self._reached[h].set)
                    self._release[h].wait(GATE_TIMEOUT_S)
                    return

        self._hook = self.engine.model.register_forward_pre_hook(before_forward)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for release in self._release.values():
            release.set()
        self._hook.remove()

    async def reached(self, h: Hold) -> None:
        """Until the step held by ``h`` waits at the gate (60 s bound)."""
        with trio.fail_after(60):
            await self._reached[h].wait()

    def release(self, h: Hold) -> None:
        """Let the step held by ``h`` run (now, or when it arrives)."""
        self._release[h].set()

    async def pause_at(self, h: Hold, pause: Callable[[], Awaitable[object]]) -> None:
        """Run ``pause()`` (whatever ends in the engine's ``pause``: the engine's own, a
        client's, an HTTP ``/pause``) while the step held by ``h`` waits, then release it;
        returns when ``pause()`` does. So the requests of that step are paused with exactly
        the tokens up to and including it, however fast the engine."""
        await self.reached(h)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pause)
            with trio.fail_after(60):  # the engine's flag is set as its pause starts
                while not self.engine.is_paused:  # noqa: ASYNC110 - no event for it
                    await trio.sleep(0.001)
            self.release(h)


def greedy_reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """``max_tokens`` greedy tokens of ``prompt`` alone from transformers' own forward, EOS an
    ordinary token (what ``ignore_eos=True`` asks of the engine; ``generate``'s
    ``min_new_tokens`` would forbid EOS instead, a different distribution)."""
    import torch

    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_tokens):
            token = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, token.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def client_routes() -> tuple[str, ...]:
    """The routes the trainer's client calls, but the weight-transfer ones."""
    return (*DATA_PLANE_ROUTES, *PAUSE_ROUTES, *SLEEP_ROUTES, "/reset_prefix_cache")
