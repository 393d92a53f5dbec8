"""One training run: build its parts, resume, drive ``run_training``, tear everything down.

Everything the run starts lives in ``async with`` blocks under :func:`train`, so a step
error, a deadline or Ctrl-C unwinds them in order (engines and workers stopped, files
closed) before the error reaches the command line.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import statistics
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import attrs
import torch
import trio

from engines.client import InferenceClient
from engines.types import EngineClient, SamplingParams
from engines.vllm.serve import require_vllm
from sync.transports import WeightTransport
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, to_dict
from trainer.data import RewardFunction, open_rewards
from trainer.debug import Dumper, Watchdog, open_debug_services, where_line
from trainer.errors import ConfigError
from trainer.generators import Generator
from trainer.loop import (
    RunContext,
    kl_controller,
    open_engine_recovery,
    run_training,
)
from trainer.metrics import (
    MetricsLogger,
    StepProgress,
    TrackerSink,
    eval_summary,
    mismatch_summary,
    open_run_log,
    open_trackers,
    restore_metrics,
    reward_summary,
    run_totals,
    setup_run_logging,
    teardown_run_logging,
)
from trainer.run._engines import Engines, open_engines
from trainer.run._interrupt import stop_on_interrupt
from trainer.run._parts import open_ray_cluster, open_transport, open_workers
from trainer.run._prepare import Prepared, prepare, record_config
from trainer.run._prompt_budget import check_context
from trainer.run._teacher import open_teacher
from trainer.vocabulary import install_faults, open_owner_nursery, unfired_faults
from trainer.workers.group import WorkerGroup
from trainer.workers.policy import preload_model_code

__all__ = ["train", "with_run_dir"]

log = logging.getLogger("trainer.run")


def with_run_dir(cfg: Config) -> Config:
    """``cfg`` with ``trainer.run_dir`` chosen: as given, else ``runs/<timestamp>``."""
    if cfg.trainer.run_dir:
        return cfg
    chosen = f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, run_dir=chosen))


#: The mode of a run directory the trainer makes: its config, logs and checkpoints are the
#: user's alone on a shared host (an existing directory keeps the mode it has).
RUN_DIR_MODE = 0o700


def _make_run_dir(run_dir: Path) -> None:
    """Create ``run_dir`` with mode 0700 (its missing parents as the umask makes them); an
    existing one is left as it is. Blocking."""
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir(mode=RUN_DIR_MODE)
    except FileExistsError:
        if not run_dir.is_dir():
            raise
    else:
        run_dir.chmod(RUN_DIR_MODE)  # whatever the umask


def _check_run_dir(cfg: Config) -> Path:
    """The run directory (``trainer.run_dir``, else ``runs/<timestamp>``), after
    :func:`_refuse_a_second_run`; nothing is made (blocking: it reads the directory)."""
    run_dir = Path(with_run_dir(cfg).trainer.run_dir or "")
    _refuse_a_second_run(cfg.trainer.resume_mode, cfg.trainer.ckpt_interval, run_dir)
    return run_dir


def _refuse_a_second_run(resume_mode: str, ckpt_interval: int, run_dir: Path) -> None:
    """``ConfigError`` where a run would replace the record of one that already logged steps
    in ``run_dir`` (a fresh start there rewrites ``metrics.jsonl`` and leaves that run's
    checkpoints beside its own): a fresh run (``resume_mode=none``), or ``resume_mode=latest``
    that finds no checkpoint to continue from where that run ended (its ``summary.json``) or
    saves none (``trainer.ckpt_interval=0``). A run killed before its first checkpoint, which
    a scheduler relaunches with ``resume_mode=latest``, starts again from step 0 (as a resume
    drops the lines after its checkpoint). ``resume_mode=path`` names its checkpoint."""
    metrics = run_dir / "metrics.jsonl"
    if resume_mode == "path" or not metrics.is_file() or metrics.stat().st_size == 0:
        return
    latest = CheckpointManager(run_dir / "checkpoints").latest()
    ended = (run_dir / "summary.json").is_file()
    if latest is None and resume_mode == "latest" and not ended and ckpt_interval > 0:
        return
    lines = metrics.read_text(errors="replace").count("\n")
    held = f"config: trainer.run_dir={str(run_dir)!r} already holds a run ({lines} lines in its metrics.jsonl"
    if latest is not None and resume_mode == "none":
        raise ConfigError(
            f"{held}, its latest checkpoint {latest.name}): continue it with "
            "trainer.resume_mode=latest, or give a new trainer.run_dir (or remove that "
            "directory); a fresh run there would replace that run's metrics"
        )
    if latest is None:
        asked = (
            "trainer.resume_mode=latest found no checkpoint of it"
            if resume_mode == "latest"
            else "it saved no checkpoint"
        )
        raise ConfigError(
            f"{held}) and {asked} (trainer.ckpt_interval=0?), so it cannot be continued: "
            "give a new trainer.run_dir, or remove that directory; a fresh run there would "
            "replace that run's metrics"
        )


class _TeardownClock:
    """Logs how long stopping engines and workers took after a failure (bounded by design)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def start(self) -> None:
        self._started = time.monotonic()

    def report(self, *exc_info: object) -> None:
        if self._started is not None:
            log.info("teardown after failure took %.2fs", time.monotonic() - self._started)


async def train(cfg: Config) -> dict[str, Any]:
    """Run training as configured; returns the summary (also written to ``summary.json``).

    Nothing is written before the run is accepted: every refusal of :func:`prepare` (a
    generator class that is not one, a batch larger than the data, a resume that changes
    the data order, ...) and of :func:`_refuse_a_second_run` comes before the run directory,
    ``train.log`` or ``config.yaml`` exist. The log records of that phase are held and
    written to ``train.log`` first once it does (:func:`open_run_log`). A directory the run
    makes has mode 0700.
    """
    if cfg.plan.engine_backend.runs_vllm:  # before any work: one line
        require_vllm(f"engine.backend={cfg.engine.backend}")
    # the run's own files are made, read and written in threads (DESIGN 3 rule 1): a slow
    # or network disk stalls a worker thread, never the loop
    run_dir = await trio.to_thread.run_sync(_check_run_dir, cfg)
    handlers = setup_run_logging()  # held in memory until the run is accepted
    _limit_torch_threads(cfg)
    dumper = Dumper(run_dir)
    w = cfg.trainer.watchdog
    watchdog = Watchdog(
        dumper,
        after_s=w.after_s,
        min_s=w.min_s,
        first_step_s=w.first_step_s,
        step_timeout_s=cfg.trainer.step_timeout_s,
        enabled=w.enabled,
    )
    summary: dict[str, Any] = {}
    try:
        async with stop_on_interrupt(
            lambda: where_line(dumper.local()), grace_s=cfg.trainer.interrupt_grace_s
        ):
            with StepProgress(
                enabled=cfg.trainer.progress, one_update_per_batch=cfg.plan.one_update_per_batch
            ) as progress:
                prepared = await prepare(cfg, run_dir, progress)  # every refusal, nothing written
                await trio.to_thread.run_sync(_make_run_dir, run_dir)
                await trio.to_thread.run_sync(open_run_log, handlers, run_dir)
                install_faults(cfg.faults, fired_log=run_dir / "faults_fired.log")
                if cfg.plan.correction_note:  # fully-async: what it corrects with, said once
                    log.warning(cfg.plan.correction_note)
                async with open_debug_services(dumper) as services:
                    await services.start(watchdog.run)
                    summary = await _train(cfg, run_dir, prepared, dumper, watchdog, progress)
        return summary
    except BaseException as exc:
        # the CLI prints the one-line message; the log keeps the exact fields (elapsed to the
        # ms) and the whole traceback (INFO: the console handler shows WARNING and up only)
        log.info("run failed: %r", exc, exc_info=exc)
        raise
    finally:
        for fault in unfired_faults():
            log.warning(
                "fault %r never fired: the run never reached %s on the steps it names",
                str(fault),
                fault.op,
            )
        teardown_run_logging(handlers)


def _limit_torch_threads(cfg: Config) -> None:
    """On a CPU-only machine, the trainer's share of the cores (the plan's ``threads``)."""
    if cfg.plan.threads is not None:
        torch.set_num_threads(cfg.plan.threads.trainer)


async def _train(
    cfg: Config,
    run_dir: Path,
    prepared: Prepared,
    dumper: Dumper,
    watchdog: Watchdog,
    progress: StepProgress,
) -> dict[str, Any]:
    """Start-up (each phase shown by ``progress``), resume, the steps, then the summary; a
    fresh run records its ``config.yaml`` first (a resume once its checkpoint has loaded).

    Whatever starts is entered on one exit stack, so it stops in the reverse order.
    """
    if prepared.resume_from is None:
        await trio.to_thread.run_sync(record_config, cfg, run_dir)
    if prepared.resume_from is not None and int(prepared.state["step"]) >= prepared.last_step:
        return await trio.to_thread.run_sync(_nothing_to_train, run_dir, prepared)
    async with open_owner_nursery() as preloading, AsyncExitStack() as stack:
        # the workers' model code is imported while the servers start (seconds each)
        preloading.start_soon(trio.to_thread.run_sync, preload_model_code, prepared.model_dir)
        teardown = _TeardownClock()
        stack.push(teardown.report)  # pushed first, so it runs after everything else is stopped
        parts = await _open_parts(stack, cfg, run_dir, prepared, dumper, progress)
        ctx = await _open_run_context(stack, cfg, run_dir, prepared, parts, watchdog, progress)
        ctx.versions.resumed(int(prepared.state.get("weight_version", 0)))  # syncs so far
        progress.start_steps(ctx.last_step, start=ctx.first_step - 1)
        trio.lowlevel.add_instrument(ctx.stalls)
        stack.callback(trio.lowlevel.remove_instrument, ctx.stalls)
        try:
            await run_training(ctx)
        except BaseException:
            teardown.start()
            raise
    restarts = ctx.recovery.events if ctx.recovery else None
    return await trio.to_thread.run_sync(_summarize, run_dir, ctx.metrics.path, restarts)


@attrs.frozen
class _Parts:
    """The run's services, engines, workers and weight transport, each on the run's exit stack."""

    #: ``data``'s reward, with its worker processes (``data.reward_workers``).
    reward_fn: RewardFunction
    trackers: TrackerSink
    engines: Engines
    workers: WorkerGroup
    transport: WeightTransport
    #: ``algorithm.distillation``'s teacher engine; None when the run distills nothing.
    teacher: InferenceClient | None = None


async def _open_parts(
    stack: AsyncExitStack,
    cfg: Config,
    run_dir: Path,
    prepared: Prepared,
    dumper: Dumper,
    progress: StepProgress,
) -> _Parts:
    """Start the rewards' workers, the trackers, Ray, the engines, the workers and the weight
    transport, in that order, each entered on ``stack`` (so stopped in the reverse order)."""
    # the reward's worker processes (data.reward_workers) live as long as the run
    reward_fn = await stack.enter_async_context(open_rewards(cfg.data, prepared.reward_fn))
    trackers = await _open_trackers(stack, cfg, run_dir, progress)
    if cfg.plan.uses_ray:
        with progress.phase("ray"):
            await stack.enter_async_context(open_ray_cluster(cfg))
    with progress.phase("engines"):
        engines = await stack.enter_async_context(open_engines(cfg, prepared.model_dir, run_dir))
        max_tokens = cfg.generator.sampling.max_tokens
        check_context(await engines.client.max_model_len(), prepared.fitted, max_tokens)
        _announce(progress, engines.started)
    if cfg.algorithm.distillation.enabled:
        with progress.phase("teacher"):
            teacher = await stack.enter_async_context(open_teacher(cfg, run_dir))
    else:
        teacher = None
    dumper.engine_urls = tuple(getattr(engines.client, "urls", ()))
    dumper.engine_api_key = engines.api_key
    with progress.phase("workers"):
        workers = await stack.enter_async_context(open_workers(cfg, prepared.model_dir))
    with progress.phase("weight transport"):
        transport = await stack.enter_async_context(
            open_transport(cfg, run_dir, engines.client, workers)
        )
    return _Parts(reward_fn, trackers, engines, workers, transport, teacher)


def _announce(progress: StepProgress, lines: tuple[str, ...]) -> None:
    """Each line on the console (as the start-up phases are shown; nothing with
    ``trainer.progress=false``) and in ``train.log``."""
    for line in lines:
        log.info("%s", line)
        if progress.enabled:
            progress.console.print(line, markup=False, highlight=False, soft_wrap=True)
        elif progress.plain:
            print(line, file=progress.console.file, flush=True)


async def _open_trackers(
    stack: AsyncExitStack, cfg: Config, run_dir: Path, progress: StepProgress
) -> TrackerSink:
    """The trackers of ``trainer.loggers`` besides ``metrics.jsonl``, entered on ``stack``."""
    t = cfg.trainer
    if not set(t.loggers) - {"jsonl"}:
        return TrackerSink()
    with progress.phase("trackers"):
        return await stack.enter_async_context(
            open_trackers(
                t.loggers,
                run_dir,
                project=t.project_name,
                run_name=t.run_name or run_dir.name,
                wandb_mode=t.wandb_mode,
                mlflow_tracking_uri=t.mlflow_tracking_uri,
                config=to_dict(cfg),
            )
        )


async def _open_run_context(
    stack: AsyncExitStack,
    cfg: Config,
    run_dir: Path,
    prepared: Prepared,
    parts: _Parts,
    watchdog: Watchdog,
    progress: StepProgress,
) -> RunContext:
    """The context the steps share: the engines watched (``engine.max_restarts``), the
    policy resumed, ``metrics.jsonl`` open and the generators running, each on ``stack``."""
    engine = parts.engines.client
    recovery = await stack.enter_async_context(
        open_engine_recovery(cfg, engine, parts.engines.processes, parts.transport, parts.workers)
    )
    if recovery is not None and "engine_recovery" in prepared.state:
        recovery.carry_over(prepared.state["engine_recovery"])
    start = await _resume_policy(cfg, run_dir, prepared, parts.workers, progress)
    metrics = await _open_metrics(stack, run_dir, start, prepared)
    generator, eval_generator, eval_sampled_generator = await _open_generators(
        stack, cfg, prepared, parts.reward_fn, engine
    )
    return RunContext(
        cfg=cfg,
        run_dir=run_dir,
        tokenizer=prepared.tokenizer,
        strategy=prepared.strategy,
        generator=generator,
        eval_generator=eval_generator,
        eval_examples=prepared.fitted[1].examples,
        engine=engine,
        transport=parts.transport,
        workers=parts.workers,
        ckpt=prepared.ckpt,
        metrics=metrics,
        progress=progress,
        first_step=start + 1,
        last_step=prepared.last_step,
        watchdog=watchdog,
        trackers=parts.trackers,
        eval_sampled_generator=eval_sampled_generator,
        recovery=recovery,
        teacher=parts.teacher,
        kl_ctrl=kl_controller(cfg, prepared.state),
    )


async def _resume_policy(
    cfg: Config, run_dir: Path, prepared: Prepared, workers: WorkerGroup, progress: StepProgress
) -> int:
    """The step the run resumes after (0: a fresh run). On resume, the checkpoint's policy is
    loaded into ``workers``, then the run is accepted: ``config.yaml`` is recorded."""
    if prepared.resume_from is None:
        return 0
    with progress.phase("resume"):
        await workers.load_checkpoint(prepared.resume_from)
        start = int(prepared.state["step"])
    await trio.to_thread.run_sync(record_config, cfg, run_dir)
    log.info("resumed from %s at step %d", prepared.resume_from, start)
    return start


async def _open_metrics(
    stack: AsyncExitStack, run_dir: Path, start: int, prepared: Prepared
) -> MetricsLogger:
    """``metrics.jsonl`` holding steps up to ``start`` only (:func:`restore_metrics`, with the
    resumed checkpoint's row), open for the steps' rows and closed by ``stack``."""
    path = run_dir / "metrics.jsonl"
    await trio.to_thread.run_sync(restore_metrics, path, start, prepared.state.get("metrics"))
    return stack.enter_context(await trio.to_thread.run_sync(MetricsLogger, path))


async def _open_generators(
    stack: AsyncExitStack,
    cfg: Config,
    prepared: Prepared,
    reward_fn: RewardFunction,
    engine: EngineClient,
) -> tuple[Generator, Generator | None, Generator | None]:
    """The training generator (on the strategy's rollout engine), the greedy eval one and the
    sampled eval one (None when their eval is off), each's ``running`` entered on ``stack``."""
    t, s = cfg.trainer, cfg.generator.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)

    make = functools.partial(_make_generator, cfg, prepared, reward_fn)
    generator = make(prepared.strategy.rollout_engine(engine, cfg), sampling)
    eval_generator = (
        make(engine, SamplingParams(temperature=0.0, max_tokens=s.max_tokens))
        if t.eval_interval
        else None
    )
    eval_sampled_generator = (
        make(engine, sampling) if t.eval_interval and t.eval_n_samples_per_prompt else None
    )
    for made in (generator, eval_generator, eval_sampled_generator):
        if made is not None:  # each one's run-scoped resources (Generator.running)
            await stack.enter_async_context(made.running())
    return generator, eval_generator, eval_sampled_generator


def _make_generator(
    cfg: Config,
    prepared: Prepared,
    reward_fn: RewardFunction,
    engine: EngineClient,
    sampling: SamplingParams,
) -> Generator:
    """``generator.cls`` on ``engine``, sampling with ``sampling``."""
    return prepared.generator_cls(
        engine=engine,
        tokenizer=prepared.tokenizer,
        reward_fn=reward_fn,
        sampling=sampling,
        max_turns=cfg.generator.max_turns,
        max_response_tokens=cfg.generator.max_response_tokens,
        **cfg.generator.kwargs,
    )


def _nothing_to_train(run_dir: Path, prepared: Prepared) -> dict[str, Any]:
    """A resume from the run's last step: said, and its summary returned as it stands (no
    model, engine or worker started; blocking)."""
    log.warning(
        "nothing to train: %s is at step %d, the run's last (trainer.max_steps or its epochs); "
        "raise trainer.max_steps to go on",
        prepared.resume_from,
        int(prepared.state["step"]),
    )
    recorded = run_dir / "summary.json"
    if recorded.is_file():  # as the run wrote it, where it ended at this checkpoint's step
        summary = json.loads(recorded.read_text())
        if summary.get("last_step") == int(prepared.state["step"]):
            return summary
    return _summarize(run_dir, run_dir / "metrics.jsonl")


def _summarize(
    run_dir: Path, metrics_path: Path, restarts: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    rows = (
        [json.loads(line) for line in metrics_path.read_text().splitlines()]
        if metrics_path.exists()
        else []
    )
    steps = [r for r in rows if "reward/mean" in r]
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        **reward_summary([r["reward/mean"] for r in steps]),
        **eval_summary(rows),
    }
    if steps:
        # a row restored from a checkpoint (see restore_metrics) has no timings
        times = [r["timing/step"] for r in steps if "timing/step" in r]
        summary["step_time_mean_s"] = statistics.fmean(times) if times else None
        summary["last_step"] = steps[-1]["step"]
    summary["totals"] = run_totals(steps)
    if mismatch := mismatch_summary(steps):
        summary["mismatch"] = mismatch
    if restarts is not None:  # engine recovery was on: how often it brought an engine back
        summary["engine_restarts"] = len(restarts)
        summary["engine_restart_events"] = restarts
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
