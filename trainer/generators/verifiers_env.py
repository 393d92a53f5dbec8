"""Train on verifiers 0.4 environments (Prime Intellect's ``verifiers.v1``: tasksets, harnesses,
``Env.run_episode``)::

    .venv/bin/python -m trainer generator.cls=trainer.generators.verifiers_env:VerifiersGenerator \\
        generator.kwargs.taskset.id=examples.verifiers_reasoning_gym \\
        generator.kwargs.harness.id=examples.verifiers_reasoning_gym.harness

One episode per trajectory, each a verifiers episode of one task of the environment's
taskset, run as an asyncio task through the trio-asyncio bridge (:mod:`engines.bridge`). Its
model calls are verifiers' training client's: it renders the chat itself (``renderers``, with
the run's tokenizer) and calls the token-in route ``/inference/v1/generate``, here through
the capture proxy in front of the run's engines (:mod:`trainer.generators.token_capture`:
one base URL for the run, each episode routed to one engine by its session id, the run's
sampling, each episode seeded with its trajectory's seed, ``operation("generate")``; and the
logprob entries adapted to what ``renderers`` parses, :mod:`trainer.generators.token_in`).
The trajectory is the trace's (:mod:`trainer.generators.verifiers_traces`): its token ids, its
sampled mask as the loss mask, its logprobs as the rollout logprobs, its reward (the
taskset's own rewards, summed), one sample per trainable branch.

**Run-scoped** (:meth:`VerifiersGenerator.running`, entered by the run once): the
environment is loaded (in a thread), one bridge is opened (one for all of the run's verifiers
generators: :func:`_run_bridge`), the capture proxy is started, and one ``env.serving()`` is
held for the whole run, in an asyncio task the generator's nursery owns; leaving closes
serving (bounded by :data:`SERVING_CLOSE_TIMEOUT_S`), then the proxy and the loop.

**Tasks**: the taskset's, in its order, one per group (GRPO compares a group's samples of one
task): group ``k`` of step ``s`` gets task ``((s - 1) * groups + k) % len(tasks)``. The
run's own data (``data.task``, ``data.train``) only sets how many groups a step has and how
many steps an epoch has; the trainer's prompts are not used.

**Failed episodes** (not ``ok``, no sampled token, or raised) train nothing: loss mask 0, the
mean reward of the group's successful episodes, counted in ``generate/failed_episodes``
(:mod:`trainer.generators.verifiers_traces`).

Needs engines reachable over HTTP (``engine.backend=local``, ``vllm`` or ``remote``), and
verifiers installed (``pip install -e '.[verifiers]'``).
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from engines.bridge import Bridge, open_bridge
from engines.client import InferenceClient
from trainer.errors import ConfigError
from trainer.generators._base import Generator, GeneratorInput, GeneratorOutput
from trainer.generators.token_capture import CaptureProxy, open_capture_proxy
from trainer.generators.verifiers_load import (
    LoadedEnvironment,
    check_spec,
    load_environment,
    model_context,
)
from trainer.generators.verifiers_traces import EpisodeOutcome, outcome_of, trajectories_of
from trainer.vocabulary import open_owner_nursery, operation

__all__ = ["SERVING_CLOSE_TIMEOUT_S", "VerifiersGenerator"]

log = logging.getLogger(__name__)

#: Seconds ``env.serving()`` gets to close when the run ends before it is cancelled.
SERVING_CLOSE_TIMEOUT_S = 30.0
#: The capture proxy's one key (base URL) for all of a generator's episodes.
_PROXY_KEY = "verifiers"


async def _serve(env: Any, started: trio.Event, stop: asyncio.Event) -> None:
    """Asyncio side: hold ``env.serving()`` until ``stop`` is set (or this task is cancelled).
    (trio-asyncio runs asyncio tasks in trio's thread, so setting a trio event is safe.)"""
    async with env.serving():
        started.set()
        await stop.wait()


#: The run's asyncio loop for verifiers, while a generator's :meth:`VerifiersGenerator.running`
#: block that opened it is open (see :func:`_run_bridge`).
_run_bridge_open: Bridge | None = None


@asynccontextmanager
async def _run_bridge() -> AsyncIterator[Bridge]:
    """One asyncio loop for all of a run's verifiers generators (training and eval): the first
    ``running`` block opens it, the others, entered inside that block (the run enters and
    leaves them as a stack), share it.

    One loop, because renderers 0.1.12 (verifiers' client) serializes its ``/v1/models``
    look-up with a module-level ``asyncio.Lock``, which asyncio binds to the first loop that
    waits on it: calls from a second loop then fail (``RuntimeError: ... is bound to a
    different event loop``). A run's loop is new, so the lock is renewed with it (a second run
    in one process, as in the tests).
    """
    global _run_bridge_open
    if _run_bridge_open is not None:
        yield _run_bridge_open
        return
    async with open_bridge() as bridge:
        import renderers.client

        setattr(renderers.client, "_max_prompt_len_lock", asyncio.Lock())  # noqa: B010
        _run_bridge_open = bridge
        try:
            yield bridge
        finally:
            _run_bridge_open = None


def _freeze_heap() -> None:
    """Leave what the process holds at start-up (torch, the model, verifiers' modules) out of
    every later garbage collection (``gc.freeze``, after a last full collection).

    verifiers allocates enough per episode to set off a full collection every step or two, and
    a full collection of the trainer's heap took 450-600 ms, on the event loop (measured
    2026-12-04: ``loop/max_stall_ms`` 450-600 in ``trio_asyncio``'s loop task, each stall a
    ``gc`` generation-2 pass of the same length). Objects frozen here are never collected:
    start-up garbage is collected first.
    """
    gc.collect()
    gc.freeze()


class VerifiersGenerator(Generator):
    """Runs a verifiers environment's episodes against the run's engines (module docstring).

    ``taskset``: verifiers' taskset config (``{"id": MODULE, ...its fields}``); ``harness``:
    its harness config (None: the taskset's default harness); ``runtime``: where a harness
    program runs (default a local subprocess; verifiers' own default is remote sandboxes).
    ``generator.max_turns`` is the agent's ``max_turns``.
    """

    def __init__(
        self,
        *,
        taskset: Mapping[str, object] | None = None,
        harness: Mapping[str, object] | None = None,
        runtime: Mapping[str, object] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self._taskset = check_spec("taskset", taskset, required=True)
        self._harness = check_spec("harness", harness, required=False)
        if runtime is not None and not isinstance(runtime, Mapping):
            raise ConfigError(
                f"config: generator.kwargs.runtime must be a mapping, got {runtime!r}"
            )
        self._runtime = dict(runtime) if runtime is not None else None
        self._loaded: LoadedEnvironment | None = None
        self._bridge: Bridge | None = None
        self._proxy: CaptureProxy | None = None
        self._model: str | None = None

    @asynccontextmanager
    async def running(self) -> AsyncIterator[None]:
        """Load the environment, open the bridge and hold ``env.serving()`` for the block."""
        assert self._taskset is not None
        engine = self._http_engine()
        loaded = await trio.to_thread.run_sync(
            load_environment, self._taskset, self._harness, self._runtime, self.max_turns
        )
        async with (
            _run_bridge() as bridge,
            open_capture_proxy(engine, self.sampling) as proxy,
            open_owner_nursery() as nursery,
        ):
            stop = asyncio.Event()
            serving = trio.Event()

            async def hold() -> None:
                await bridge.run(_serve, loaded.env, serving, stop)

            nursery.start_soon(hold)
            await serving.wait()
            _freeze_heap()
            self._loaded, self._bridge, self._proxy = loaded, bridge, proxy
            try:
                yield
            finally:
                self._loaded = self._bridge = self._proxy = None
                stop.set()
                nursery.cancel_scope.deadline = trio.current_time() + SERVING_CLOSE_TIMEOUT_S

    @property
    def environment(self) -> Any:
        """The verifiers ``Env`` while :meth:`running` holds it; None outside that block."""
        return None if self._loaded is None else self._loaded.env

    @property
    def tasks(self) -> tuple[Any, ...]:
        """The taskset's tasks while :meth:`running` holds the environment (else empty)."""
        return () if self._loaded is None else self._loaded.tasks

    def _http_engine(self) -> InferenceClient:
        if not isinstance(self.engine, InferenceClient):
            raise ConfigError(
                f"config: {type(self).__name__} needs the engines' HTTP client (engine.backend="
                f"local, vllm or remote, trainer.strategy=sync); it was given "
                f"{type(self.engine).__name__} (an in-process engine, or the weight-version "
                "wrapper of trainer.strategy=fully_async)"
            )
        return self.engine

    async def generate(self, batch: GeneratorInput) -> GeneratorOutput:
        loaded, bridge, proxy = self._loaded, self._bridge, self._proxy
        if loaded is None or bridge is None or proxy is None:
            raise RuntimeError(f"{type(self).__name__}.generate outside its running() block")
        model = await self._served_model(self._http_engine())
        # one base URL for the run: verifiers keeps one client per distinct client config until
        # serving ends (a URL per trajectory made a client, and a /v1/models look-up, per
        # episode); the proxy routes each episode by its X-Session-ID, and its record of the
        # calls (unused here: the traces hold the tokens) is cleared each step
        base_url = proxy.register(_PROXY_KEY, 0)
        tasks = self._tasks_for(batch, loaded.tasks)
        outcomes: list[EpisodeOutcome | None] = [None] * len(batch)

        async def one(i: int) -> None:
            ctx = model_context(
                base_url,
                model,
                str(self.tokenizer.name_or_path),
                self.sampling.temperature,
                self.sampling.max_tokens,
                seed=batch[i].seed,
            )
            try:
                with operation("env_step"):  # verifiers' own awaits; model calls: generate
                    outcomes[i] = outcome_of(
                        await bridge.run(loaded.env.run_episode, tasks[i], ctx)
                    )
            except Exception as exc:  # an episode that raised is a failed episode
                outcomes[i] = EpisodeOutcome.raised(exc)

        async with open_owner_nursery() as nursery:
            for i in range(len(batch)):
                nursery.start_soon(one, i)
        return trajectories_of(
            batch,
            [o for o in outcomes if o is not None],
            decode=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            max_response_tokens=self.max_response_tokens,
        )

    async def _served_model(self, engine: InferenceClient) -> str:
        """The engines' served model name (what the client's ``/v1/models`` look-up needs)."""
        if self._model is None:
            url = f"{engine.url_for(None)}/v1/models"
            async with httpx.AsyncClient(timeout=60) as http:
                response = await http.get(url, headers=engine.headers)
            response.raise_for_status()
            self._model = engine.model or str(response.json()["data"][0]["id"])
        return self._model

    @staticmethod
    def _tasks_for(batch: GeneratorInput, tasks: tuple[Any, ...]) -> list[Any]:
        """Each trajectory's task: one per group, in the taskset's order (module docstring)."""
        groups: dict[int, int] = {}
        for item in batch:
            groups.setdefault(item.group_id, len(groups))
        first = max(batch.global_step - 1, 0) * len(groups)
        return [tasks[(first + groups[item.group_id]) % len(tasks)] for item in batch]
