"""The training service ends a session without heartbeats (its models stopped and freed) and
forgets old answers: the timing on trio's MockClock, the freeing with a real model."""

from __future__ import annotations

import gc
import json
import weakref
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from engines.local.http import Request
from trainer.serve._app import ServiceApp, ServiceSpec
from trainer.serve._engine import SamplerEngines
from trainer.serve._futures import Answer
from trainer.serve._http import RequestError
from trainer.serve._models import ModelState
from trainer.serve._sessions import check_period_s, end_idle_sessions_forever

KEY = "tml-test"


def _spec(**kw: Any) -> ServiceSpec:
    from engines.models import resolve_model_path

    return ServiceSpec(
        base_models={"tiny": lambda: resolve_model_path(None)},
        available={"tiny": True},
        timeout_s=60.0,
        api_key=KEY,
        checkpoint_dir=Path("unused"),
        **kw,
    )


def _post(path: str, body: dict[str, Any]) -> Request:
    return Request("POST", f"/api/v1/{path}", {}, {}, json.dumps(body).encode())


async def _session(app: ServiceApp) -> str:
    return json.loads((await app.create_session(_post("create_session", {}))).body)["session_id"]


async def test_a_session_without_heartbeats_ends_with_its_models_and_answers_expire(
    autojump_clock: trio.testing.MockClock, tmp_path: Path
) -> None:
    spec = _spec(session_timeout_s=180.0, future_ttl_s=600.0)
    assert check_period_s(180.0, 600.0) == 10.0
    async with trio.open_nursery() as nursery:
        app = ServiceApp(spec, nursery, SamplerEngines(spec.sampling, nursery, tmp_path))
        alive, idle = await _session(app), await _session(app)
        # a model of the idle session with an operation queued behind a missing seq_id
        state = ModelState("m-idle", idle, "tiny", Any, app.futures, 60.0)  # type: ignore[arg-type]
        app.add_model(state)
        queued = state.submit(2, "optim_step", lambda model: {})
        answered = app.futures.new()
        app.futures.resolve(answered, Answer(b"{}"))
        pending = app.futures.new()
        # no garbage collection here: a thread's real seconds would skew the virtual clock
        nursery.start_soon(partial(end_idle_sessions_forever, app, collect=None))
        for _ in range(20):  # 200 s: the alive session beats every 10 s, the idle one never
            await trio.sleep(10)
            await app.session_heartbeat(_post("session_heartbeat", {"session_id": alive}))
        assert idle not in app.sessions and alive in app.sessions
        assert app.models == {}
        reason = f"session {idle} ended: no heartbeat for serve.session_timeout_s=180s"
        assert state.broken == f"{reason}; model m-idle was freed"
        failed = json.loads((await app.futures.wait(queued, 0)).body)  # type: ignore[union-attr]
        assert failed == {"error": state.broken, "category": "server"}
        with pytest.raises(RequestError) as gone:
            await app.session_heartbeat(_post("session_heartbeat", {"session_id": idle}))
        assert (gone.value.status, gone.value.message) == (410, reason)
        assert answered in app.futures  # 200 s after its answer: kept
        await trio.sleep(620)  # the idle session's answers came at 190 s; checks every 10 s
        assert answered not in app.futures and queued not in app.futures
        assert pending in app.futures  # never answered: never forgotten
        nursery.cancel_scope.cancel()


async def test_a_real_model_of_an_ended_session_is_freed(tmp_path: Path) -> None:
    spec = _spec(session_timeout_s=0.4, future_ttl_s=60.0)
    async with trio.open_nursery() as nursery:
        app = ServiceApp(spec, nursery, SamplerEngines(spec.sampling, nursery, tmp_path))
        session = await _session(app)
        body = {"session_id": session, "model_seq_id": 0, "base_model": "tiny"}
        created = await app.create_model(_post("create_model", body | {"lora_config": {"rank": 2}}))
        answer = await app.futures.wait(json.loads(created.body)["request_id"], 60)
        assert answer is not None
        model_id = json.loads(answer.body)["model_id"]
        model = app.models[model_id].model
        freed = [
            weakref.ref(model),
            weakref.ref(model.worker.model),
            weakref.ref(model.worker.optimizer),
        ]
        del model, answer
        nursery.start_soon(end_idle_sessions_forever, app)
        await trio.sleep(1.0)  # past 0.4 s without a heartbeat, and a 0.1 s period
        assert model_id not in app.models
        await trio.to_thread.run_sync(gc.collect)
        assert [ref() for ref in freed] == [None, None, None]
        nursery.cancel_scope.cancel()
