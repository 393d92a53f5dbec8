"""One training run: build its parts, resume, drive ``train_loop``, tear everything down.

Everything the run starts lives in ``async with`` blocks under :func:`train`, so a step
error, a deadline or Ctrl-C unwinds them in order (engines and workers stopped, files
closed) before the error reaches the command line.
"""

from __future__ import annotations

import datetime
import functools
import json
import logging
import os
import statistics
import time
from contextlib import AsyncExitStack
from importlib import import_module
from pathlib import Path
from typing import Any

import attrs
import torch
import trio
import yaml

from engines.models import load_tokenizer, resolve_model_path
from engines.types import SamplingParams
from engines.vllm.serve import require_vllm
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, to_dict
from trainer.data import PromptLoader, load_datasets, open_rewards
from trainer.debug import Dumper, Watchdog, open_debug_services, where_line
from trainer.errors import ConfigError
from trainer.generators import Generator, check_generator_kwargs
from trainer.loop import (
    PromptStream,
    RunContext,
    make_strategy,
    one_update_per_batch,
    open_engine_recovery,
    resync_engines,
    run_training,
)
from trainer.metrics import (
    MetricsLogger,
    StepProgress,
    TrackerSink,
    eval_summary,
    open_trackers,
    restore_metrics,
    reward_summary,
    setup_run_logging,
    teardown_run_logging,
)
from trainer.run._engines import open_engines
from trainer.run._interrupt import stop_on_interrupt
from trainer.run._parts import (
    cpu_threads,
    open_ray_cluster,
    open_transport,
    open_workers,
    uses_ray,
)
from trainer.run._prompt_budget import check_context, fit_prompts
from trainer.vocabulary import install_faults, open_owner_nursery, unfired_faults
from trainer.workers.policy import preload_model_code

__all__ = ["train", "with_run_dir"]

log = logging.getLogger("trainer.run")


def with_run_dir(cfg: Config) -> Config:
    """``cfg`` with ``trainer.run_dir`` chosen: as given, else ``runs/<timestamp>``."""
    if cfg.trainer.run_dir:
        return cfg
    chosen = f"runs/{datetime.datetime.now():%Y%m%d-%H%M%S}"
    return attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, run_dir=chosen))


def _make_run_dir(cfg: Config) -> Path:
    """Create the run directory (``trainer.run_dir``, else ``runs/<timestamp>``)."""
    run_dir = Path(with_run_dir(cfg).trainer.run_dir or "")
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def _record_config(cfg: Config, run_dir: Path) -> None:
    """Write ``RUN_DIR/config.yaml``: the configuration, with the directory the run chose.

    Called once the run is accepted: at once for a fresh run, after the checkpoint has
    loaded for a resume, so a refused resume leaves the file that its error tells you to
    resume with. The recorded ``trainer.run_dir`` is never None, so ``--config
    RUN_DIR/config.yaml trainer.resume_mode=latest`` resumes in the same directory. The file
    is replaced atomically: a run killed while writing it leaves the old one.
    """
    recorded = attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, run_dir=str(run_dir)))
    tmp = run_dir / "config.yaml.tmp"
    tmp.write_text(yaml.safe_dump(to_dict(recorded), sort_keys=False))
    os.replace(tmp, run_dir / "config.yaml")


def _load_generator_cls(spec: str) -> type[Generator]:
    module_name, _, name = spec.partition(":")
    try:
        cls = getattr(import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"config: generator.cls={spec!r} cannot be imported: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, Generator)):
        raise ConfigError(
            f"config: generator.cls={spec!r} is not a subclass of trainer.generators.Generator"
        )
    return cls


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
    """Run training as configured; returns the summary (also written to ``summary.json``)."""
    if cfg.engine.backend in ("vllm", "vllm_inprocess"):  # before any work: one line
        require_vllm(f"engine.backend={cfg.engine.backend}")
    # the run's own files are made, read and written in threads (DESIGN 3 rule 1): a slow
    # or network disk stalls a worker thread, never the loop
    run_dir = await trio.to_thread.run_sync(_make_run_dir, cfg)
    handlers = await trio.to_thread.run_sync(setup_run_logging, run_dir)
    install_faults(cfg.faults, fired_log=run_dir / "faults_fired.log")
    _limit_torch_threads(cfg)
    dumper = Dumper(run_dir)
    w = cfg.trainer.watchdog
    watchdog = Watchdog(
        dumper,
        after_s=w.after_s,
        min_s=w.min_s,
        step_timeout_s=cfg.trainer.step_timeout_s,
        enabled=w.enabled,
    )
    summary: dict[str, Any] = {}
    try:
        async with stop_on_interrupt(
            lambda: where_line(dumper.local()), grace_s=cfg.trainer.interrupt_grace_s
        ):
            async with open_debug_services(dumper) as services:
                await services.start(watchdog.run)
                with StepProgress(
                    enabled=cfg.trainer.progress, one_update_per_batch=one_update_per_batch(cfg)
                ) as progress:
                    summary = await _train(cfg, run_dir, dumper, watchdog, progress)
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
    """On a CPU-only machine, the trainer's share of the cores (:func:`trainer.run._parts.cpu_threads`)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(cpu_threads(cfg).trainer)


async def _train(
    cfg: Config, run_dir: Path, dumper: Dumper, watchdog: Watchdog, progress: StepProgress
) -> dict[str, Any]:
    """Start-up (each phase shown by ``progress``), resume, the steps, then the summary."""
    t = cfg.trainer
    # a generator that does not import, or kwargs it cannot take, fail before any model loads
    generator_cls = _load_generator_cls(cfg.generator.cls)
    check_generator_kwargs(generator_cls, cfg.generator.kwargs)
    with progress.phase("model"):
        model_dir = await trio.to_thread.run_sync(resolve_model_path, cfg.model.path)
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_dir)
    data = await trio.to_thread.run_sync(load_datasets, cfg.data, t.seed)
    # every prompt rendered with this tokenizer (or it fails here), measured and bounded
    fitted = [
        await trio.to_thread.run_sync(fit_prompts, tokenizer, checked, source, cfg.data)
        for source, checked in (
            (cfg.data.train or f"data.task={cfg.data.task}", data.train),
            (cfg.data.eval or f"data.task={cfg.data.task} (eval)", data.eval),
        )
    ]
    examples, eval_examples = fitted[0].examples, fitted[1].examples
    strategy = make_strategy(cfg, examples)  # trainer.strategy, decided here once
    last_step = strategy.loader.batches_per_epoch * t.epochs
    if t.max_steps is not None:
        last_step = min(last_step, t.max_steps)
    # each checkpoint's policy/ gets the tokenizer too: a model directory to serve as it is
    ckpt = CheckpointManager(run_dir / "checkpoints", t.max_ckpts_to_keep, tokenizer_from=model_dir)
    # a resume that changes the data order is refused here, before anything starts
    resume_from, state = await _read_resume_state(cfg, ckpt, strategy.order)
    if resume_from is None:
        await trio.to_thread.run_sync(_record_config, cfg, run_dir)
    s = cfg.generator.sampling
    sampling = SamplingParams(temperature=s.temperature, top_p=s.top_p, max_tokens=s.max_tokens)
    async with open_owner_nursery() as preloading, AsyncExitStack() as stack:
        # the workers' model code is imported while the servers start (seconds each)
        preloading.start_soon(trio.to_thread.run_sync, preload_model_code, model_dir)
        teardown = _TeardownClock()
        stack.push(teardown.report)  # pushed first, so it runs after everything else is stopped
        # the reward's worker processes (data.reward_workers) live as long as the run
        reward_fn = await stack.enter_async_context(open_rewards(cfg.data, data.reward_fn))
        trackers = TrackerSink()
        if set(t.loggers) - {"jsonl"}:
            with progress.phase("trackers"):
                trackers = await stack.enter_async_context(
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
        if uses_ray(cfg):
            with progress.phase("ray"):
                await stack.enter_async_context(open_ray_cluster(cfg))
        with progress.phase("engines"):
            engines = await stack.enter_async_context(open_engines(cfg, model_dir, run_dir))
            engine = engines.client
            check_context(await engine.max_model_len(), fitted, s.max_tokens)
        dumper.engine_urls = tuple(getattr(engine, "urls", ()))
        dumper.engine_api_key = cfg.engine.api_key
        with progress.phase("workers"):
            workers = await stack.enter_async_context(open_workers(cfg, model_dir))
        with progress.phase("weight transport"):
            transport = await stack.enter_async_context(
                open_transport(cfg, run_dir, engine, workers)
            )
        recovery = await stack.enter_async_context(
            open_engine_recovery(cfg.engine, engine, engines.processes, transport, workers)
        )

        rollout_engine = strategy.rollout_engine(engine, cfg)

        def make_generator(sp: SamplingParams, engine: Any = engine) -> Generator:
            return generator_cls(
                engine=engine,
                tokenizer=tokenizer,
                reward_fn=reward_fn,
                sampling=sp,
                max_turns=cfg.generator.max_turns,
                max_response_tokens=cfg.generator.max_response_tokens,
                **cfg.generator.kwargs,
            )

        start = 0
        metrics_path = run_dir / "metrics.jsonl"
        if resume_from is not None:
            with progress.phase("resume"):
                await workers.load_checkpoint(resume_from)
                start = int(state["step"])
            await trio.to_thread.run_sync(_record_config, cfg, run_dir)
            log.info("resumed from %s at step %d", resume_from, start)
        await trio.to_thread.run_sync(restore_metrics, metrics_path, start, state.get("metrics"))
        metrics = stack.enter_context(await trio.to_thread.run_sync(MetricsLogger, metrics_path))
        generator = make_generator(sampling, rollout_engine)
        eval_generator = (
            make_generator(SamplingParams(temperature=0.0, max_tokens=s.max_tokens))
            if t.eval_interval
            else None
        )
        eval_sampled_generator = (
            make_generator(sampling) if t.eval_interval and t.eval_n_samples_per_prompt else None
        )
        for made in (generator, eval_generator, eval_sampled_generator):
            if made is not None:  # each one's run-scoped resources (Generator.running)
                await stack.enter_async_context(made.running())
        ctx = RunContext(
            cfg=cfg,
            run_dir=run_dir,
            tokenizer=tokenizer,
            strategy=strategy,
            generator=generator,
            eval_generator=eval_generator,
            eval_examples=eval_examples,
            engine=engine,
            transport=transport,
            workers=workers,
            ckpt=ckpt,
            metrics=metrics,
            progress=progress,
            first_step=start + 1,
            last_step=last_step,
            watchdog=watchdog,
            trackers=trackers,
            eval_sampled_generator=eval_sampled_generator,
            recovery=recovery,
        )
        if recovery is not None:
            recovery.set_resync(functools.partial(resync_engines, ctx))
        strategy.versions.resumed(int(state.get("weight_version", 0)))  # syncs so far
        progress.start_steps(last_step, start=start)
        trio.lowlevel.add_instrument(ctx.stalls)
        stack.callback(trio.lowlevel.remove_instrument, ctx.stalls)
        try:
            await run_training(ctx)
        except BaseException:
            teardown.start()
            raise
    restarts = recovery.events if recovery else None
    return await trio.to_thread.run_sync(_summarize, run_dir, metrics_path, restarts)


async def _read_resume_state(
    cfg: Config, ckpt: CheckpointManager, order: PromptLoader | PromptStream
) -> tuple[Path | None, dict[str, Any]]:
    """The checkpoint to resume from and its trainer state, or ``(None, {})`` for a fresh run.

    The data position is loaded into ``order`` now, so a resume whose data order differs
    from the checkpoint's (another seed, another prompt count, the other strategy) raises
    ``ConfigError`` before the run starts anything or rewrites ``config.yaml``.
    """
    t = cfg.trainer
    resume_from = await trio.to_thread.run_sync(ckpt.resolve, t.resume_mode, t.resume_path)
    if resume_from is None:
        if t.resume_mode != "none":
            log.warning(
                "resume_mode=%s but no checkpoint under %s: starting fresh",
                t.resume_mode,
                ckpt.root,
            )
        return None, {}
    state = await trio.to_thread.run_sync(ckpt.read_trainer_state, resume_from)
    order.load_state_dict(state["loader"])
    return resume_from, state


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
    if restarts is not None:  # engine recovery was on: how often it brought an engine back
        summary["engine_restarts"] = len(restarts)
        summary["engine_restart_events"] = restarts
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary
