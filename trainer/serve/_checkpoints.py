"""The service's checkpoints: ``save_weights`` (the SDK's ``save_state``), ``load_weights``
(``load_state``, ``load_state_with_optimizer``, ``create_training_client_from_state``),
``weights_info``, ``training_runs`` and a run's ``checkpoints`` (list, delete).

A ``tinker://RUN/weights/NAME`` path is the folder ``RUN/weights/NAME`` under
``serve.checkpoint_dir``; ``RUN`` is the model's id (the SDK's training run). Each part is one
name of letters, digits and ``._:-`` that is neither ``.`` nor ``..``, and the folder must
resolve inside the root: ``tinker://../..`` and its kin are refused, as the client's error.

A save writes everything (the adapter as a peft directory, the optimizer's, scheduler's and
RNG's states, :data:`META_FILE`) into a ``.tmp-*`` folder beside its place, fsyncs every
file and the folder, and renames it into place (an ``overwrite`` moves the old one aside
first and removes it after): a checkpoint folder only ever appears complete, as
:mod:`trainer.checkpoint`'s do. Saves and loads are operations of their model, in the
client's order and under ``serve.request_timeout_s``; file work runs in threads.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import trio

from engines.local.http import Request, Response
from trainer.checkpoint import remove_folder_atomically, write_folder_atomically
from trainer.serve._futures import Answer, failed
from trainer.serve._http import API, RequestError, int_field, json_body, json_response
from trainer.serve._models import ModelState

if TYPE_CHECKING:
    from trainer.serve._futures import FutureStore
    from trainer.workers.service_model import ServiceModel


class _Spec(Protocol):
    @property
    def checkpoint_dir(self) -> Path: ...
    @property
    def base_models(self) -> dict[str, Callable[[], Any]]: ...
    @property
    def available(self) -> dict[str, bool]: ...
    @property
    def timeout_s(self) -> float: ...


class _Session(Protocol):
    @property
    def session_id(self) -> str: ...
    @property
    def model_seq_ids(self) -> dict[int, str]: ...


class ServiceApp(Protocol):
    """What the checkpoint routes use of the service's app (``trainer.serve._app``, which
    imports this module: a protocol, not an import, keeps the two acyclic)."""

    @property
    def spec(self) -> _Spec: ...
    @property
    def models(self) -> dict[str, ModelState]: ...
    @property
    def futures(self) -> FutureStore: ...
    @property
    def nursery(self) -> trio.Nursery: ...
    def model_state(self, model_id: Any) -> ModelState: ...
    def session_of(self, session_id: Any) -> _Session: ...
    def add_model(self, state: ModelState) -> None: ...


__all__ = ["META_FILE", "CheckpointStore", "TinkerPath"]

SCHEME = "tinker://"
#: The kind of checkpoint this service writes (Tinker's ``training`` checkpoints).
KIND = "weights"
#: What a checkpoint says about itself: its base model, adapter shape, time, metadata.
META_FILE = "tinker_checkpoint.json"
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_TMP = ".tmp-"


@attrs.frozen
class TinkerPath:
    """``tinker://RUN/weights/NAME``, its parts checked."""

    run: str
    name: str

    @property
    def uri(self) -> str:
        return f"{SCHEME}{self.run}/{KIND}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        return f"{KIND}/{self.name}"

    @classmethod
    def parse(cls, path: Any) -> TinkerPath:
        """``ValueError`` naming the path for anything but a well-formed weights path."""
        if not isinstance(path, str) or not path.startswith(SCHEME):
            raise ValueError(f"{path!r} is not a tinker:// path (tinker://RUN/weights/NAME)")
        parts = path[len(SCHEME) :].split("/")
        if len(parts) != 3 or parts[1] != KIND:
            raise ValueError(
                f"{path!r}: this service reads tinker://RUN/weights/NAME paths only "
                "(sampler and external weights are not checkpoints here)"
            )
        return cls(run=check_part(parts[0], path), name=check_part(parts[2], path))


def check_part(part: str, where: str) -> str:
    if not _PART.fullmatch(part) or part in (".", ".."):
        raise ValueError(
            f"{where!r}: {part!r} is not a checkpoint name (letters, digits and ._:- only, "
            "not . or ..)"
        )
    return part


@attrs.frozen
class CheckpointStore:
    """The checkpoint folders under ``root``. Every method blocks (file I/O): call it in a
    thread."""

    root: Path

    def folder(self, path: TinkerPath) -> Path:
        """Where ``path`` lives; ``ValueError`` if it would resolve outside the root."""
        root = self.root.resolve()
        folder = (root / path.run / KIND / path.name).resolve()
        if not folder.is_relative_to(root) or folder == root:
            raise ValueError(f"{path.uri} resolves outside serve.checkpoint_dir")
        return folder

    def existing(self, path: TinkerPath) -> Path:
        folder = self.folder(path)
        if not (folder / META_FILE).is_file():
            raise ValueError(f"no checkpoint {path.uri} on this service")
        return folder

    def save(self, path: TinkerPath, meta: dict[str, Any], write: Any, *, overwrite: bool) -> None:
        """``write(folder)`` then ``meta``, atomically at ``path``'s folder."""

        def write_all(folder: Path) -> None:
            write(folder)
            (folder / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")

        try:
            write_folder_atomically(
                self.folder(path), write_all, overwrite=overwrite, tmp_prefix=_TMP
            )
        except FileExistsError:
            raise ValueError(
                f"{path.uri} exists: save under another name or with overwrite"
            ) from None

    def meta(self, path: TinkerPath) -> dict[str, Any]:
        return json.loads((self.existing(path) / META_FILE).read_text())

    def delete(self, path: TinkerPath) -> None:
        remove_folder_atomically(self.existing(path), tmp_prefix=_TMP)

    def runs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / KIND).is_dir())

    def checkpoints(self, run: str) -> list[dict[str, Any]]:
        """The SDK's ``Checkpoint`` of each checkpoint of ``run``, oldest first."""
        check_part(run, run)
        kind_dir = self.root / run / KIND
        out = []
        for folder in sorted(kind_dir.iterdir()) if kind_dir.is_dir() else []:
            if folder.name.startswith(_TMP) or not (folder / META_FILE).is_file():
                continue
            meta = json.loads((folder / META_FILE).read_text())
            path = TinkerPath(run, folder.name)
            out.append(
                {
                    "checkpoint_id": path.checkpoint_id,
                    "checkpoint_type": "training",
                    "time": meta["time"],
                    "tinker_path": path.uri,
                    "size_bytes": sum(
                        f.stat().st_size for f in (f for f in folder.rglob("*") if f.is_file())
                    ),
                    "public": False,
                    "user_metadata": meta.get("user_metadata"),
                    "expires_at": None,
                }
            )
        return sorted(out, key=lambda c: c["time"])


def _meta(state: ModelState, user_metadata: Any) -> dict[str, Any]:
    model = state.model
    targets = model.target_modules
    return {
        "base_model": state.base_model,
        "lora_rank": model.rank,
        "lora_alpha": model.alpha,
        "target_modules": list(targets),
        "seed": model.seed,
        "train_attn": "all-linear" in targets or "q_proj" in targets,
        "train_mlp": "all-linear" in targets or "gate_proj" in targets,
        "time": datetime.now(UTC).isoformat(),
        "user_metadata": user_metadata if isinstance(user_metadata, dict) else None,
    }


def _store(app: ServiceApp) -> CheckpointStore:
    return CheckpointStore(Path(app.spec.checkpoint_dir))


def _parse(path: Any) -> TinkerPath:
    try:
        return TinkerPath.parse(path)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None


# -- routes ---------------------------------------------------------------------------------------


async def save_weights(app: ServiceApp, request: Request) -> Response:
    body = json_body(request)
    state = app.model_state(body.get("model_id"))
    store, overwrite = _store(app), bool(body.get("overwrite", False))
    user_metadata = body.get("user_metadata")

    # a bad name fails in the operation's answer: its seq_id is taken, later ones wait on it
    def run(model: ServiceModel) -> dict[str, Any]:
        name = str(body.get("path") or f"step-{model.optim_steps:06d}")
        path = TinkerPath(state.model_id, check_part(name, name))
        store.save(path, _meta(state, user_metadata), model.save_state, overwrite=overwrite)
        return {"path": path.uri, "type": "save_weights"}

    request_id = state.submit(int_field(body, "seq_id"), "save_weights", run)
    return json_response({"request_id": request_id, "model_id": state.model_id})


async def load_weights(app: ServiceApp, request: Request) -> Response:
    body = json_body(request)
    optimizer = bool(body.get("optimizer", False))
    store = _store(app)
    if body.get("session_id") is not None:  # create-via-load: a new model, from the checkpoint
        return await _create_from(app, body, _parse(body.get("path")), optimizer)
    state = app.model_state(body.get("model_id"))

    def run(model: ServiceModel) -> dict[str, Any]:
        path = TinkerPath.parse(body.get("path"))
        model.load_state(store.existing(path), optimizer=optimizer)
        return {"path": path.uri, "model_id": state.model_id, "type": "load_weights"}

    request_id = state.submit(int_field(body, "seq_id"), "load_weights", run)
    return json_response({"request_id": request_id, "model_id": state.model_id})


async def _create_from(
    app: ServiceApp, body: dict[str, Any], path: TinkerPath, optimizer: bool
) -> Response:
    session = app.session_of(body.get("session_id"))
    seq = int_field(body, "model_seq_id")
    if seq in session.model_seq_ids:
        return json_response({"request_id": session.model_seq_ids[seq]})
    model_id = f"{session.session_id}:train:{seq}"  # the id the SDK derives
    request_id = app.futures.new()
    session.model_seq_ids[seq] = request_id
    app.nursery.start_soon(
        _load_new_model,
        app,
        session.session_id,
        model_id,
        path,
        optimizer,
        body.get("base_model"),
        request_id,
    )
    return json_response({"request_id": request_id, "model_id": model_id})


async def _load_new_model(
    app: ServiceApp,
    session_id: str,
    model_id: str,
    path: TinkerPath,
    optimizer: bool,
    base_override: Any,
    request_id: str,
) -> None:
    from trainer.workers.service_model import ServiceModel

    store = _store(app)

    def build() -> tuple[str, ServiceModel]:
        meta = store.meta(path)
        base = meta["base_model"]
        if base_override not in (None, base):
            raise ValueError(
                f"{path.uri} was trained on {base!r}: base_model {base_override!r} cannot load it"
            )
        if base not in app.spec.base_models or not app.spec.available[base]:
            raise ValueError(f"{path.uri} was trained on {base!r}, which is not offered here")
        model = ServiceModel(
            app.spec.base_models[base](),
            rank=int(meta["lora_rank"]),
            alpha=int(meta["lora_alpha"]),
            target_modules=tuple(meta["target_modules"]),
            seed=int(meta["seed"]),
        )
        model.load_state(store.existing(path), optimizer=optimizer)
        return base, model

    answer: dict[str, Any] = {}
    with trio.move_on_after(app.spec.timeout_s) as scope:
        try:
            base, model = await trio.to_thread.run_sync(build, abandon_on_cancel=True)
        except ValueError as exc:
            answer = failed(f"load_weights: {exc}")
        except Exception as exc:
            answer = failed(f"load_weights: {type(exc).__name__}: {exc}", category="server")
        else:
            state = ModelState(model_id, session_id, base, model, app.futures, app.spec.timeout_s)
            app.add_model(state)
            answer = {"path": path.uri, "model_id": model_id, "type": "load_weights"}
    if scope.cancelled_caught:
        answer = failed(
            f"load_weights did not finish within serve.request_timeout_s={app.spec.timeout_s:g}s",
            category="server",
        )
    app.futures.resolve(request_id, Answer(json.dumps(answer).encode()))


async def weights_info(app: ServiceApp, request: Request) -> Response:
    path = _parse(json_body(request).get("tinker_path"))
    meta = await _in_thread(_store(app).meta, path)
    return json_response(
        {
            "base_model": meta["base_model"],
            "optimizer_config": {"type": "adamw"},
            "is_lora": True,
            "lora_rank": meta["lora_rank"],
            "train_unembed": False,
            "train_mlp": meta["train_mlp"],
            "train_attn": meta["train_attn"],
        }
    )


async def training_runs(app: ServiceApp, request: Request) -> Response:
    store = _store(app)
    on_disk = await trio.to_thread.run_sync(store.runs)
    ids = sorted(set(on_disk) | set(app.models))
    try:
        offset, limit = int(request.arg("offset") or 0), int(request.arg("limit") or 20)
    except ValueError:
        raise RequestError(400, "training_runs: offset and limit must be integers") from None
    runs = [await _run(app, store, i) for i in ids[offset : offset + limit]]
    cursor = {"offset": offset, "limit": limit, "total_count": len(ids)}
    return json_response({"training_runs": runs, "cursor": cursor})


async def training_run_paths(app: ServiceApp, request: Request) -> Response:
    """``training_runs/{id}``, ``.../checkpoints`` (GET) and ``.../checkpoints/weights/NAME``
    (DELETE)."""
    rest = request.path.removeprefix(f"{API}/training_runs/").split("/")
    store = _store(app)
    run_id = rest[0]
    if request.method == "GET" and len(rest) == 1:
        return json_response(await _run(app, store, run_id))
    if request.method == "GET" and rest[1:] == ["checkpoints"]:
        try:
            listed = await trio.to_thread.run_sync(store.checkpoints, run_id)
        except ValueError as exc:
            raise RequestError(400, str(exc)) from None
        return json_response({"checkpoints": listed, "cursor": None})
    if request.method == "DELETE" and rest[1:2] == ["checkpoints"] and len(rest) == 4:
        path = _parse(f"{SCHEME}{run_id}/{rest[2]}/{rest[3]}")
        await _in_thread(store.delete, path)
        return json_response({})
    raise RequestError(404, f"{request.method} {request.path} is not served")


async def user_checkpoints(app: ServiceApp, request: Request) -> Response:
    store = _store(app)

    def every() -> list[dict[str, Any]]:
        return [c for run in store.runs() for c in store.checkpoints(run)]

    listed = await trio.to_thread.run_sync(every)
    return json_response(
        {
            "checkpoints": listed,
            "cursor": {"offset": 0, "limit": len(listed), "total_count": len(listed)},
        }
    )


async def _run(app: ServiceApp, store: CheckpointStore, run_id: str) -> dict[str, Any]:
    """The SDK's ``TrainingRun`` of a live model or of checkpoints on disk."""
    try:
        listed = await trio.to_thread.run_sync(store.checkpoints, run_id)
    except ValueError as exc:
        raise RequestError(400, str(exc)) from None
    state = app.models.get(run_id)
    if state is not None:
        base, rank = state.base_model, state.model.rank
    elif listed:
        meta = await _in_thread(store.meta, TinkerPath.parse(listed[-1]["tinker_path"]))
        base, rank = meta["base_model"], meta["lora_rank"]
    else:
        raise RequestError(404, f"no training run {run_id!r} on this service")
    return {
        "training_run_id": run_id,
        "base_model": base,
        "model_owner": "local",
        "is_lora": True,
        "corrupted": state is not None and state.broken is not None,
        "lora_rank": rank,
        "last_request_time": listed[-1]["time"] if listed else datetime.now(UTC).isoformat(),
        "last_checkpoint": listed[-1] if listed else None,
        "last_sampler_checkpoint": None,
        "user_metadata": None,
    }


async def _in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a thread; its ``ValueError`` is the client's (404: no such
    checkpoint, 400: a bad path)."""
    try:
        return await trio.to_thread.run_sync(fn, *args)
    except ValueError as exc:
        status = 404 if str(exc).startswith("no checkpoint") else 400
        raise RequestError(status, str(exc)) from None
