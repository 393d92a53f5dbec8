"""Sampling clients: sampler saves, sampling sessions and samples (the SDK's
``save_weights_for_sampler``, ``create_sampling_session``, ``asample``, ``samplers/{id}``).

A sampler save is an operation of its training model (run in the model's ``seq_id`` order,
under ``serve.request_timeout_s``): the model's LoRA adapter goes into its base model's engine
(:mod:`trainer.serve._engine`) through the trainer's own weight sync,
:func:`sync.weights.sync_weights` with :class:`sync.transports.LoraAdapterTransport`
(``/v1/load_lora_adapter`` in the pause bracket), then, as ``sync.verify`` says, the engine is
checked against the model (:func:`sync.verify.verify_sync`: a probe's logprobs within the
tolerance). Each save is a snapshot, an adapter of its own name: a sampler keeps the weights it
was saved with. The last :data:`KEPT_UNNAMED` unnamed saves of a model stay loaded (older ones
are unloaded); named ones (``save_weights_for_sampler(name)``, a ``tinker://`` path) for the
service's life.

A sample (``asample``) answers a future at once and runs concurrently with every other;
its answer is the SDK's protobuf ``SampleResponse``. What a request asks that is not served is
answered in the SDK's error shape, saying so.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import re
import shutil
import uuid
from collections.abc import Callable
from typing import Any

import attrs
import trio

from engines.local.http import Request, Response
from sync.bracket import Bracket
from sync.transports import LoraAdapterTransport
from sync.verify import verify_sync
from sync.weights import sync_weights
from trainer.errors import InferenceServerError, WeightSyncTimeoutError
from trainer.serve._engine import SamplerEngine, SamplerEngines
from trainer.serve._futures import PROTOBUF, Answer, FutureStore, failed
from trainer.serve._http import RequestError
from trainer.serve._http import error_response as _error
from trainer.serve._http import int_field as _int
from trainer.serve._http import json_body as _body
from trainer.serve._http import json_response as _json
from trainer.serve._models import ModelState
from trainer.serve._sample_io import SampleAsk, encode_sample_response, read_sample_request
from trainer.vocabulary import step_deadline
from trainer.workers.service_model import ServiceModel

__all__ = ["KEPT_UNNAMED", "PROBE_PROMPT", "Sampler", "SamplingRoutes", "Snapshot"]

log = logging.getLogger(__name__)

#: Unnamed sampler saves of a model that stay loaded (an RL loop saves one per step).
KEPT_UNNAMED = 8
#: The probe ``sync.verify`` samples (as the trainer's: fixed ids any vocabulary has).
PROBE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
#: A sampler save's name: what a ``tinker://`` path segment holds.
NAME = re.compile(r"[A-Za-z0-9._-]{1,128}")


@attrs.define(eq=False)
class Snapshot:
    """One sampler save: the adapter the engine serves it under."""

    path: str
    model_id: str
    base_model: str
    adapter: str
    lora_rank: int
    named: bool
    #: Why it is no longer served (unloaded to make room); None while it is.
    dropped: str | None = None


@attrs.frozen
class Sampler:
    """A sampling session: a base model, and the snapshot it samples (None: the base)."""

    sampler_id: str
    base_model: str
    snapshot: Snapshot | None = None


class _Rank0:
    """A training model as the weight sync's policy rank 0 (``sync.transports.base.Rank0``):
    ``fn(peft model, *args)`` in a thread, in eval mode (the probe's scores)."""

    def __init__(self, model: ServiceModel) -> None:
        self._model = model.worker.model

    async def run_on_rank0(
        self, fn: Callable[..., Any], *args: object, abandon_on_cancel: bool = False
    ) -> Any:
        def call() -> Any:
            self._model.train(False)
            return fn(self._model, *args)

        return await trio.to_thread.run_sync(call, abandon_on_cancel=abandon_on_cancel)


class SamplingRoutes:
    """The sampling half of the service (module docstring); ``models``, ``sessions`` and
    ``futures`` are the service's own; ``base_models[name]()`` is a base model's directory
    (blocking)."""

    def __init__(
        self,
        *,
        engines: SamplerEngines,
        futures: FutureStore,
        models: dict[str, ModelState],
        sessions: dict[str, Any],
        base_models: dict[str, Callable[[], Any]],
        available: dict[str, bool],
        nursery: trio.Nursery,
        timeout_s: float,
    ) -> None:
        self.engines = engines
        self.futures = futures
        self.models = models
        self.sessions = sessions
        self.base_models = base_models
        self.available = available
        self.nursery = nursery
        self.timeout_s = timeout_s
        self.samplers: dict[str, Sampler] = {}
        self.snapshots: dict[str, Snapshot] = {}
        #: Each session's sampling sessions by the SDK's ``sampling_session_seq_id``.
        self._session_seq: dict[tuple[str, int], str] = {}
        self._verified: set[str] = set()
        self._count = itertools.count(1)

    # -- routes -----------------------------------------------------------------------------------

    async def save_weights_for_sampler(self, request: Request) -> Response:
        try:
            body = _body(request)
            state = self._model(body.get("model_id"))
            seq_id = _int(body, "seq_id")
            name = body.get("path")
            if name is not None and (not isinstance(name, str) or not NAME.fullmatch(name)):
                raise RequestError(400, f"path {name!r}: a name of letters, digits, '.', '_', '-'")
        except RequestError as exc:
            return _error(exc.status, exc.message)
        path = f"tinker://{state.model_id}/sampler_weights/{name or uuid.uuid4().hex}"
        save = functools.partial(self._save, state, path, named=name is not None)
        request_id = state.submit(seq_id, "save_weights_for_sampler", save, awaits=True)
        return _json({"request_id": request_id, "model_id": state.model_id})

    async def create_sampling_session(self, request: Request) -> Response:
        try:
            body = _body(request)
            session_id = body.get("session_id")
            if not isinstance(session_id, str) or session_id not in self.sessions:
                raise RequestError(404, f"no session {session_id!r} (create_session first)")
            key = (session_id, _int(body, "sampling_session_seq_id"))
            if key not in self._session_seq:  # a resend gets the first one's
                sampler = self._sampler_of(body.get("model_path"), body.get("base_model"))
                self._session_seq[key] = sampler.sampler_id
        except RequestError as exc:
            return _error(exc.status, exc.message)
        return _json(
            {"type": "create_sampling_session", "sampling_session_id": self._session_seq[key]}
        )

    async def get_sampler(self, request: Request) -> Response:
        sampler = self.samplers.get(request.path.rsplit("/", 1)[-1])
        if sampler is None:
            return _error(404, f"no sampler at {request.path}")
        path = sampler.snapshot.path if sampler.snapshot is not None else None
        return _json(
            {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": path}
        )

    async def asample(self, request: Request) -> Response:
        try:
            body = _body(request)
            session = body.get("sampling_session_id")
            if session is not None:
                sampler = self.samplers.get(session) if isinstance(session, str) else None
                if sampler is None:
                    raise RequestError(404, f"no sampling session {session!r} on this service")
            else:
                sampler = self._sampler_of(body.get("model_path"), body.get("base_model"))
            n = _int(body, "num_samples") if "num_samples" in body else 1
            if n < 1:
                raise RequestError(400, f"num_samples must be at least 1, not {n}")
        except RequestError as exc:
            return _error(exc.status, exc.message)
        request_id = self.futures.new()
        try:
            ask = read_sample_request(body)
        except ValueError as exc:
            self.futures.resolve(request_id, _failed(f"sample: {exc}"))
        else:
            self.nursery.start_soon(self._sample, sampler, ask, n, request_id)
        ids = [f"{request_id}-{i}" for i in range(n)]
        return _json({"request_id": request_id, "sample_sequence_ids": ids})

    # -- what runs --------------------------------------------------------------------------------

    async def _save(self, state: ModelState, path: str, model: ServiceModel, *, named: bool) -> Any:
        """A sampler save (the model's operation): the adapter synced and checked."""
        if path in self.snapshots:
            raise ValueError(f"{path} is saved already: give another name")
        adapter = f"sampler-{next(self._count)}"
        settings = self.engines.settings
        with step_deadline(model.optim_steps, self.timeout_s, WeightSyncTimeoutError):
            engine = await self.engines.engine(state.base_model, self.base_models[state.base_model])
            client = engine.client(adapter)
            rank0 = _Rank0(model)
            transport = LoraAdapterTransport(self.engines.adapter_dir / adapter, adapter)
            await transport.init(client, rank0)
            await sync_weights(
                client,
                rank0,
                transport,
                bracket=Bracket.PAUSE,
                pause_mode=settings.pause_mode,  # type: ignore[arg-type]
                grace_s=settings.transfer_grace_s,
            )
            first = state.model_id not in self._verified
            if settings.verify == "every" or (settings.verify == "first" and first):
                await verify_sync(
                    client,
                    rank0,
                    PROBE_PROMPT,
                    tolerance=settings.verify_tolerance,
                    weight_version=model.optim_steps,
                )
                self._verified.add(state.model_id)
        snapshot = Snapshot(path, state.model_id, state.base_model, adapter, model.rank, named)
        self.snapshots[path] = snapshot
        await self._drop_old(engine, state.model_id)
        if named:
            return {"type": "save_weights_for_sampler", "path": path}
        sampler = self._new_sampler(state.base_model, snapshot)
        return {"type": "save_weights_for_sampler", "sampling_session_id": sampler.sampler_id}

    async def _drop_old(self, engine: SamplerEngine, model_id: str) -> None:
        """Unload the model's unnamed snapshots beyond the last :data:`KEPT_UNNAMED`."""
        unnamed = [
            s
            for s in self.snapshots.values()
            if s.model_id == model_id and not s.named and s.dropped is None
        ]
        for old in unnamed[:-KEPT_UNNAMED]:
            old.dropped = (
                f"its weights were unloaded: the service keeps the last {KEPT_UNNAMED} unnamed "
                "sampler saves of a model (save_weights_for_sampler(name) keeps one)"
            )
            try:
                await engine.unload(old.adapter)
            except InferenceServerError as exc:
                log.warning("unloading %s: %s", old.adapter, exc)
            directory = self.engines.adapter_dir / old.adapter
            await trio.to_thread.run_sync(functools.partial(shutil.rmtree, directory, True))

    async def _sample(self, sampler: Sampler, ask: SampleAsk, n: int, request_id: str) -> None:
        answer = _failed(
            f"sample did not finish within serve.request_timeout_s={self.timeout_s:g}s",
            category="server",
        )
        with trio.move_on_after(self.timeout_s):
            answer = await self._sampled(sampler, ask, n)
        self.futures.resolve(request_id, answer)

    async def _sampled(self, sampler: Sampler, ask: SampleAsk, n: int) -> Answer:
        snapshot = sampler.snapshot
        if snapshot is not None and snapshot.dropped is not None:
            return _failed(
                f"sample: sampler {sampler.sampler_id} of {snapshot.path}: {snapshot.dropped}"
            )
        try:
            engine = await self.engines.engine(
                sampler.base_model, self.base_models[sampler.base_model]
            )
            client = engine.client(snapshot.adapter if snapshot is not None else None)
            completions = await client.generate_n(ask.prompt, ask.params, n)
        except InferenceServerError as exc:
            category = "user" if exc.status == 400 else "server"
            return _failed(f"sample: {exc}", category=category)
        except Exception as exc:
            log.exception("sample on %s failed", sampler.sampler_id)
            return _failed(f"sample: {type(exc).__name__}: {exc}", category="server")
        ended = [c.finish_reason for c in completions if c.finish_reason not in ("stop", "length")]
        if ended:
            return _failed(f"sample: the engine ended a sequence with {ended[0]!r}", "server")
        return Answer(encode_sample_response(ask, completions), PROTOBUF)

    # -- lookups ----------------------------------------------------------------------------------

    def _model(self, model_id: object) -> ModelState:
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None:
            raise RequestError(404, f"no model {model_id!r} on this service")
        return model

    def _new_sampler(self, base_model: str, snapshot: Snapshot | None) -> Sampler:
        sampler = Sampler(uuid.uuid4().hex, base_model, snapshot)
        self.samplers[sampler.sampler_id] = sampler
        return sampler

    def _sampler_of(self, model_path: object, base_model: object) -> Sampler:
        """A new sampler of a ``tinker://`` sampler path, else of a base model."""
        if model_path is not None:
            snapshot = self.snapshots.get(model_path) if isinstance(model_path, str) else None
            if snapshot is None:
                raise RequestError(
                    404,
                    f"no sampler weights at {model_path!r} on this service (a path that "
                    "save_weights_for_sampler answered: tinker://MODEL/sampler_weights/NAME)",
                )
            return self._new_sampler(snapshot.base_model, snapshot)
        if not isinstance(base_model, str) or base_model not in self.base_models:
            offered = ", ".join(self.base_models)
            raise RequestError(
                400, f"base_model {base_model!r} is not offered here; offered: {offered}"
            )
        if not self.available[base_model]:
            raise RequestError(400, f"base_model {base_model!r} is offered but not installed here")
        return self._new_sampler(base_model, None)


def _failed(message: str, category: str = "user") -> Answer:
    return Answer(json.dumps(failed(message, category=category)).encode())
