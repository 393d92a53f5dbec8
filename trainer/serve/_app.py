"""The service's HTTP face: the Tinker SDK's REST routes under ``/api/v1`` (``tinker==0.38.0``),
as an ASGI app on hypercorn + trio, like the reference engine's server.

Routes served: ``healthz``, ``client/config``, ``client/dynamic_config``, ``telemetry``,
``create_session``, ``session_heartbeat``, ``get_server_capabilities``, ``create_model``,
``get_info``, ``forward_backward`` (``forward`` is its ``forward_only``), ``optim_step``,
``retrieve_future``; the sampling clients' ``save_weights_for_sampler``,
``create_sampling_session``, ``asample`` and ``samplers/{id}`` (:mod:`trainer.serve._sampling`);
the checkpoint routes of :mod:`trainer.serve._checkpoints` (``save_weights``, ``load_weights``,
``weights_info``, ``training_runs``, ``checkpoints``).
Every other path is a 404 whose body says, in the SDK's error shape
(``{"error": ..., "category": "user"}``), that this service does not serve it yet.

Every route but ``healthz`` needs the key (``X-API-Key``, what the SDK sends from
``TINKER_API_KEY``), compared as digests in constant time; without it, a 401 before the body
is read. Each request is answered within ``serve.request_timeout_s``; operations on a model
answer at once with a future (:mod:`trainer.serve._models`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import attrs
import trio

from engines.local.http import BodyTooLarge, Request, Response, answer_lifespan, read_body
from trainer.serve import _checkpoints
from trainer.serve._engine import SamplerEngines, SamplerSettings
from trainer.serve._futures import FutureStore, failed
from trainer.serve._http import API, RequestError
from trainer.serve._http import error_response as _error
from trainer.serve._http import int_field as _int
from trainer.serve._http import json_body as _body
from trainer.serve._http import json_response as _json
from trainer.serve._models import ModelState
from trainer.serve._proto import ProtoError, decode_forward_backward, encode_forward_backward_output
from trainer.serve._sampling import SamplingRoutes
from trainer.workers.service_model import AdamStep, ServiceModel

if TYPE_CHECKING:
    from hypercorn.typing import ASGIReceiveCallable, ASGISendCallable, HTTPScope, Scope

__all__ = ["API", "NOT_SERVED", "ServiceApp", "ServiceSpec"]

log = logging.getLogger(__name__)

#: The answer to a route of the SDK this slice does not serve.
NOT_SERVED = (
    "{path} is not served by this trainer's Tinker service yet (it serves training clients: "
    "create_model, forward, forward_backward, optim_step; sampling clients: "
    "save_weights_for_sampler, create_sampling_session, asample; see docs/tinker.md)"
)
#: Query for the attention and MLP projections of Llama-like models (Qwen2, SmolLM2).
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")


@attrs.frozen
class ServiceSpec:
    """What the service offers: the base models by name (each a callable that returns its
    model directory, blocking) and each request's deadline."""

    base_models: dict[str, Callable[[], Any]]
    #: Whether each base model can be trained here (its files or package are present).
    available: dict[str, bool]
    timeout_s: float
    api_key: str
    #: The sampling engines' settings and the sampler saves' (``engine.*``, ``sync.*``).
    sampling: SamplerSettings = attrs.Factory(SamplerSettings)
    #: Root of the ``tinker://`` checkpoints (``serve.checkpoint_dir``).
    checkpoint_dir: Path = Path("runs/serve/checkpoints")
    #: A session without a heartbeat this long is ended (``serve.session_timeout_s``).
    session_timeout_s: float = 180.0
    #: Answered futures are forgotten this long after their answer (``serve.future_ttl_s``).
    future_ttl_s: float = 600.0


@attrs.define(eq=False)
class _Session:
    session_id: str
    last_heartbeat: float
    model_seq_ids: dict[int, str] = attrs.Factory(dict)


Handler = Callable[["ServiceApp", Request], Awaitable[Response]]


class ServiceApp:
    """The ASGI app over the service's state; ``nursery`` owns each model's runner task."""

    def __init__(self, spec: ServiceSpec, nursery: trio.Nursery, engines: SamplerEngines) -> None:
        self.spec = spec
        self.nursery = nursery
        self.futures = FutureStore()
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, ModelState] = {}
        #: Why each ended session ended (the latest ones; :mod:`trainer.serve._sessions`).
        self.ended: dict[str, str] = {}
        self._key_digest = hashlib.sha256(spec.api_key.encode()).digest()
        self._model_dirs: dict[str, Any] = {}
        self.sampling = SamplingRoutes(
            engines=engines,
            futures=self.futures,
            models=self.models,
            sessions=self.sessions,
            base_models=spec.base_models,
            available=spec.available,
            nursery=nursery,
            timeout_s=spec.timeout_s,
        )

    # -- ASGI -------------------------------------------------------------------------------------

    async def __call__(
        self, scope: Scope, receive: ASGIReceiveCallable, send: ASGISendCallable
    ) -> None:
        if scope["type"] == "lifespan":
            await answer_lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        response = await self._handle(scope, receive)
        if response is None:
            return
        headers = [
            (b"content-type", response.content_type.encode()),
            (b"content-length", str(len(response.body)).encode()),
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def _handle(self, scope: HTTPScope, receive: ASGIReceiveCallable) -> Response | None:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        path = scope["path"]
        if path != f"{API}/healthz" and not self._authorized(headers):
            return _error(
                401, "unauthorized: send this service's key as X-API-Key (TINKER_API_KEY)"
            )
        try:
            body = await read_body(receive)
        except BodyTooLarge as exc:
            return _error(413, str(exc))
        if body is None:
            return None
        query = parse_qs(scope["query_string"].decode("latin-1"))
        request = Request(
            method=scope["method"], path=path, query=query, headers=headers, body=body
        )
        handler = ROUTES.get(path) or _prefix_route(path)
        if handler is None:
            return _error(404, NOT_SERVED.format(path=path))
        if request.method != "POST" and path in ROUTES and path not in GET_PATHS:
            return _error(405, f"{request.method} {path}: POST only")
        with trio.move_on_after(self.spec.timeout_s):
            try:
                return await handler(self, request)
            except RequestError as exc:
                return _error(exc.status, exc.message)
            except Exception as exc:
                log.exception("%s %s failed", request.method, path)
                return _error(500, f"{type(exc).__name__}: {exc}", category="server")
        return _error(
            504,
            f"{path} was not answered within serve.request_timeout_s={self.spec.timeout_s:g}s",
            category="server",
        )

    def _authorized(self, headers: dict[str, str]) -> bool:
        sent = hashlib.sha256(headers.get("x-api-key", "").encode("utf-8", "replace")).digest()
        return hmac.compare_digest(sent, self._key_digest)

    # -- the session ------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def client_config(self, request: Request) -> Response:
        # API keys only (no JWT exchange); httpx's own transport; bodies uncompressed (the
        # trainer's environment has no zstandard)
        return _json(
            {
                "pjwt_auth_enabled": False,
                "use_pyqwest_transport": False,
                "proto_compress_fwdbwd": False,
                "parallel_fwdbwd_chunks": True,
                "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False,
                "sample_join_sampling_session": False,
            }
        )

    async def client_dynamic_config(self, request: Request) -> Response:
        return _json({})

    async def telemetry(self, request: Request) -> Response:
        return _json({"status": "accepted"})  # the SDK's telemetry is not kept

    async def create_session(self, request: Request) -> Response:
        session_id = uuid.uuid4().hex
        self.sessions[session_id] = _Session(session_id, trio.current_time())
        return _json({"type": "create_session", "session_id": session_id})

    async def session_heartbeat(self, request: Request) -> Response:
        session_id = _body(request).get("session_id")
        if session_id in self.ended:  # the SDK stops its heartbeats on a 410
            raise RequestError(410, self.ended[session_id])
        session = self._session(session_id)
        session.last_heartbeat = trio.current_time()
        return _json({"type": "session_heartbeat"})

    async def get_server_capabilities(self, request: Request) -> Response:
        models = [
            {"model_name": name, "trainable": self.spec.available[name], "sampleable": True}
            for name in self.spec.base_models
        ]
        return _json({"supported_models": models})

    def add_model(self, state: ModelState) -> None:
        """Serve ``state``: its runner task starts in the service's nursery."""
        self.models[state.model_id] = state
        self.nursery.start_soon(state.run_operations)

    def model_state(self, model_id: Any) -> ModelState:
        """The model ``model_id``; ``RequestError`` (404) for an unknown one."""
        return self._model(model_id)

    def session_of(self, session_id: Any) -> _Session:
        """The session ``session_id``; ``RequestError`` (404) for an unknown one."""
        return self._session(session_id)

    def _session(self, session_id: Any) -> _Session:
        session = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if session is None:
            raise RequestError(404, f"no session {session_id!r} (create_session first)")
        return session

    def _model(self, model_id: Any) -> ModelState:
        model = self.models.get(model_id) if isinstance(model_id, str) else None
        if model is None:
            raise RequestError(404, f"no model {model_id!r} on this service")
        return model

    # -- models -----------------------------------------------------------------------------------

    async def create_model(self, request: Request) -> Response:
        body = _body(request)
        session = self._session(body.get("session_id"))
        seq = _int(body, "model_seq_id")
        if seq in session.model_seq_ids:  # a resend: the first one's future
            return _json({"request_id": session.model_seq_ids[seq]})
        base = body.get("base_model")
        if base not in self.spec.base_models:
            offered = ", ".join(self.spec.base_models)
            raise RequestError(400, f"base_model {base!r} is not offered here; offered: {offered}")
        if not self.spec.available[base]:
            raise RequestError(400, f"base_model {base!r} is offered but not installed here")
        lora = body.get("lora_config")
        if not isinstance(lora, dict):
            raise RequestError(
                400, "full fine-tuning is not served yet: create a LoRA training client"
            )
        optimizer = (body.get("optimizer_config") or {}).get("type", "adamw")
        if optimizer != "adamw":
            raise RequestError(400, f"optimizer {optimizer!r} is not served: adamw only")
        rank = _int(lora, "rank")
        if rank <= 0:
            raise RequestError(400, f"lora_config.rank must be > 0, not {rank}")
        targets = _targets(lora)
        seed = lora.get("seed")
        request_id = self.futures.new()
        session.model_seq_ids[seq] = request_id
        self.nursery.start_soon(self._create_model, session, base, rank, targets, seed, request_id)
        return _json({"request_id": request_id})

    async def _create_model(
        self,
        session: _Session,
        base: str,
        rank: int,
        targets: tuple[str, ...],
        seed: int | None,
        request_id: str,
    ) -> None:
        from trainer.serve._futures import Answer

        def build() -> ServiceModel:
            model_dir = self._model_dirs.get(base) or self.spec.base_models[base]()
            self._model_dirs[base] = model_dir
            return ServiceModel(
                model_dir, rank=rank, target_modules=targets, seed=0 if seed is None else seed
            )

        with trio.move_on_after(self.spec.timeout_s):
            try:
                model = await trio.to_thread.run_sync(build, abandon_on_cancel=True)
            except Exception as exc:
                log.exception("create_model on %s failed", base)
                answer = failed(f"create_model: {type(exc).__name__}: {exc}", category="server")
                self.futures.resolve(request_id, Answer(json.dumps(answer).encode()))
                return
            model_id = uuid.uuid4().hex
            state = ModelState(
                model_id, session.session_id, base, model, self.futures, self.spec.timeout_s
            )
            self.add_model(state)
            body = {"model_id": model_id, "type": "create_model"}
            self.futures.resolve(request_id, Answer(json.dumps(body).encode()))
            return
        answer = failed(
            f"create_model did not finish within serve.request_timeout_s={self.spec.timeout_s:g}s",
            category="server",
        )
        self.futures.resolve(request_id, Answer(json.dumps(answer).encode()))

    async def get_info(self, request: Request) -> Response:
        state = self._model(_body(request).get("model_id"))
        return _json(
            {
                "type": "get_info",
                "model_id": state.model_id,
                "model_data": {"model_name": state.base_model},
                "is_lora": True,
                "lora_rank": state.model.rank,
                "model_name": state.base_model,
            }
        )

    async def forward_backward(self, request: Request) -> Response:
        if "protobuf" not in request.headers.get("content-type", ""):
            raise RequestError(415, "forward_backward takes the SDK's protobuf body")
        if request.headers.get("content-encoding"):
            raise RequestError(415, "compressed bodies are not served (client/config says so)")
        try:
            fb = decode_forward_backward(request.body)
        except ProtoError as exc:
            raise RequestError(400, f"forward_backward: {exc}") from None
        state = self._model(fb.model_id)
        data = [(d.tokens, d.inputs) for d in fb.data]
        name = "forward" if fb.forward_only else "forward_backward"

        def run(model: ServiceModel) -> bytes:
            if fb.loss_fn not in _datum_losses():
                raise ValueError(_not_served_loss(fb.loss_fn))
            out = model.forward_backward(
                data, fb.loss_fn, backward=not fb.forward_only, loss_fn_config=fb.loss_fn_config
            )
            outputs = [{"logprobs": lp} for lp in out.logprobs]
            return encode_forward_backward_output(outputs, out.metrics)

        request_id = state.submit(fb.seq_id, name, run, protobuf=True)
        return _json({"request_id": request_id, "model_id": state.model_id})

    async def optim_step(self, request: Request) -> Response:
        body = _body(request)
        state = self._model(body.get("model_id"))
        params = body.get("adam_params")
        if not isinstance(params, dict):
            raise RequestError(400, "optim_step: adam_params only (other optimizers not served)")
        fields = {f.name for f in attrs.fields(AdamStep)}
        unknown = sorted(set(params) - fields)
        if unknown:
            raise RequestError(400, f"optim_step: unknown adam_params {unknown}")
        try:
            step = AdamStep(**{k: float(v) for k, v in params.items()})
        except (TypeError, ValueError):
            raise RequestError(400, "optim_step: adam_params must be numbers") from None

        def run(model: ServiceModel) -> dict[str, Any]:
            return {"metrics": model.optim_step(step)}

        request_id = state.submit(_int(body, "seq_id"), "optim_step", run)
        return _json({"request_id": request_id, "model_id": state.model_id})

    async def retrieve_future(self, request: Request) -> Response:
        request_id = _body(request).get("request_id")
        if not isinstance(request_id, str) or request_id not in self.futures:
            raise RequestError(404, f"no future {request_id!r} on this service")
        answer = await self.futures.wait(request_id)
        if answer is None:
            return _json({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        return Response(200, answer.body, answer.content_type)


def _datum_losses() -> tuple[str, ...]:
    from trainer.algorithms import DATUM_LOSSES

    return DATUM_LOSSES.names


#: Why a loss of the SDK is not served, where there is more to say than its absence.
REFUSED_LOSSES = {
    "stable_reinforce": "the Tinker docs this service follows do not define it",
    "custom": "server-side custom losses (create_custom_loss) are not served; "
    "forward_backward_custom with a Python function works (it needs no server loss)",
}


def _not_served_loss(loss_fn: str) -> str:
    why = REFUSED_LOSSES.get(loss_fn, "unknown loss")
    return f"loss_fn {loss_fn!r} is not served ({why}); served: {', '.join(_datum_losses())}"


def _targets(lora: dict[str, Any]) -> tuple[str, ...]:
    """peft's target modules for the SDK's ``train_attn`` / ``train_mlp``; the LM head
    (``train_unembed``) is not adapted here."""
    attn, mlp = lora.get("train_attn", True), lora.get("train_mlp", True)
    if attn and mlp:
        return ("all-linear",)
    if not (attn or mlp):
        raise RequestError(400, "train_attn and train_mlp both off: nothing to adapt here")
    return ATTN_MODULES if attn else MLP_MODULES


ROUTES: dict[str, Handler] = {
    f"{API}/healthz": ServiceApp.healthz,
    f"{API}/client/config": ServiceApp.client_config,
    f"{API}/client/dynamic_config": ServiceApp.client_dynamic_config,
    f"{API}/telemetry": ServiceApp.telemetry,
    f"{API}/create_session": ServiceApp.create_session,
    f"{API}/session_heartbeat": ServiceApp.session_heartbeat,
    f"{API}/get_server_capabilities": ServiceApp.get_server_capabilities,
    f"{API}/create_model": ServiceApp.create_model,
    f"{API}/get_info": ServiceApp.get_info,
    f"{API}/forward_backward": ServiceApp.forward_backward,
    f"{API}/optim_step": ServiceApp.optim_step,
    f"{API}/retrieve_future": ServiceApp.retrieve_future,
    f"{API}/save_weights_for_sampler": lambda app, r: app.sampling.save_weights_for_sampler(r),
    f"{API}/create_sampling_session": lambda app, r: app.sampling.create_sampling_session(r),
    f"{API}/asample": lambda app, r: app.sampling.asample(r),
}
#: Routes the SDK reads with GET (the rest are POSTs).
GET_PATHS = frozenset({f"{API}/healthz", f"{API}/get_server_capabilities"})

ROUTES |= {
    f"{API}/save_weights": _checkpoints.save_weights,
    f"{API}/load_weights": _checkpoints.load_weights,
    f"{API}/weights_info": _checkpoints.weights_info,
    f"{API}/training_runs": _checkpoints.training_runs,
    f"{API}/checkpoints": _checkpoints.user_checkpoints,
}
GET_PATHS |= {f"{API}/training_runs", f"{API}/checkpoints"}
#: Routes by path prefix (a path with ids in it), each checking its own methods.
PREFIX_ROUTES: dict[str, Handler] = {
    f"{API}/training_runs/": _checkpoints.training_run_paths,
    f"{API}/samplers/": lambda app, request: app.sampling.get_sampler(request),
}


def _prefix_route(path: str) -> Handler | None:
    return next((h for prefix, h in PREFIX_ROUTES.items() if path.startswith(prefix)), None)
