"""``algorithm.distillation``'s teacher: one engine server serving the teacher model, started
like the run's own engines (a child process, its log ``RUN_DIR/teacher/engine-0.log``, a fresh
secret), and its client; stopped when the run leaves, whatever the error."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import attrs
import trio

from engines.client import DATA_PLANE_ROUTES, InferenceClient
from engines.launch import ReferenceServers, ServersSpec, new_api_key, open_engine_processes
from engines.models import resolve_model_path
from engines.vllm.serve import VllmServers
from trainer.config import Config

__all__ = ["open_teacher"]


@asynccontextmanager
async def open_teacher(cfg: Config, run_dir: Path) -> AsyncIterator[InferenceClient | None]:
    """The teacher's client, its server up and answering the completions route; None when
    the run distills nothing. ``ConfigError`` for a ``teacher_path`` that is no model;
    ``EngineStartError`` (with its log's tail) when the server does not come up."""
    d = cfg.algorithm.distillation
    if d.teacher_path is None:
        yield None
        return
    plan = cfg.plan
    model_dir = await trio.to_thread.run_sync(
        functools.partial(resolve_model_path, d.teacher_path, seed=cfg.trainer.seed)
    )
    servers: ServersSpec
    if d.teacher_engine == "vllm":
        assert plan.vllm is not None, "validate_cfg: teacher_engine=vllm needs engine.backend=vllm*"
        servers = VllmServers(attrs.evolve(plan.vllm, model=str(model_dir)))
    else:
        servers = ReferenceServers(
            str(model_dir),
            cfg.trainer.seed,
            devices=plan.engine_devices[:1],
            num_threads=None if plan.threads is None else plan.threads.server,
        )
    api_key = new_api_key()
    async with (
        open_engine_processes(
            1,
            servers,
            run_dir / "teacher",
            api_key=api_key,
            startup_timeout_s=plan.timeouts.engine_startup_s,
        ) as started,
        InferenceClient(
            [p.url for p in started],
            api_key=api_key,
            max_concurrency=cfg.engine.max_concurrency,
            control_plane_timeout_s=plan.timeouts.control_plane_s,
        ) as client,
    ):
        await client.probe(DATA_PLANE_ROUTES)
        yield client
