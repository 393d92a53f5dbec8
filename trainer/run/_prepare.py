"""What a run reads and decides before it starts anything (:func:`prepare`): the generator
class, the model and tokenizer, the data and its reward, the prompts fitted to the context,
the strategy and the last step, the checkpoint to resume from; and ``config.yaml``.

A generator that does not import, a model or data file that does not load, a prompt too long,
or a resume that changes the data order fails here, before any server or worker starts and
before anything is written (the run directory is made once this has passed).
"""

from __future__ import annotations

import logging
import os
from importlib import import_module
from pathlib import Path
from typing import Any

import attrs
import trio
import yaml

from engines.models import load_tokenizer, resolve_model_path
from trainer.checkpoint import CheckpointManager
from trainer.config import Config, to_dict
from trainer.data import PromptLoader, RewardFunction, load_datasets
from trainer.errors import ConfigError
from trainer.generators import Generator, check_generator_kwargs
from trainer.loop import PromptStream, Strategy, make_strategy
from trainer.metrics import StepProgress
from trainer.run._prompt_budget import FittedPrompts, fit_prompts

__all__ = ["Prepared", "prepare", "record_config"]

log = logging.getLogger("trainer.run")


def record_config(cfg: Config, run_dir: Path) -> None:
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


@attrs.frozen
class Prepared:
    """What the run reads and decides before it starts anything: a generator that does not
    import, a model or data file that does not load, a prompt too long, or a resume that
    changes the data order fails here, before any server or worker starts."""

    #: ``generator.cls``, its ``generator.kwargs`` checked.
    generator_cls: type[Generator]
    model_dir: Path
    tokenizer: Any
    #: ``data``'s reward (bound to its worker processes when the run opens them).
    reward_fn: RewardFunction
    #: The training prompts, then the eval prompts, rendered with ``tokenizer`` and bounded.
    fitted: tuple[FittedPrompts, FittedPrompts]
    #: ``trainer.strategy``, decided here once.
    strategy: Strategy
    last_step: int
    ckpt: CheckpointManager
    #: The checkpoint the run resumes from (None: a fresh run) and its trainer state.
    resume_from: Path | None
    state: dict[str, Any]


async def prepare(cfg: Config, run_dir: Path, progress: StepProgress) -> Prepared:
    """Load and check what the run needs before it starts anything (see :class:`Prepared`).

    Writes nothing (``run_dir`` may not exist yet; a resume's checkpoints are only read): a
    refusal here leaves no trace. The run records its ``config.yaml`` once it is accepted
    (:func:`record_config`)."""
    t = cfg.trainer
    # a generator that does not import, or kwargs it cannot take, fail before any model loads
    # (importing it and reading its constructors' source touch the disk: in a thread)
    generator_cls = await trio.to_thread.run_sync(_load_generator_cls, cfg.generator.cls)
    await trio.to_thread.run_sync(check_generator_kwargs, generator_cls, cfg.generator.kwargs)
    with progress.phase("model"):
        model_dir = await trio.to_thread.run_sync(resolve_model_path, cfg.model.path)
        tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_dir)
    data = await trio.to_thread.run_sync(load_datasets, cfg.data, t.seed)
    # every prompt rendered with this tokenizer (or it fails here), measured and bounded
    train, evals = [
        await trio.to_thread.run_sync(fit_prompts, tokenizer, checked, source, cfg.data)
        for source, checked in (
            (cfg.data.train or f"data.task={cfg.data.task}", data.train),
            (cfg.data.eval or f"data.task={cfg.data.task} (eval)", data.eval),
        )
    ]
    strategy = make_strategy(cfg, train.examples)  # trainer.strategy, decided here once
    last_step = strategy.loader.batches_per_epoch * t.epochs
    if t.max_steps is not None:
        last_step = min(last_step, t.max_steps)
    # each checkpoint's policy/ gets the tokenizer too: a model directory to serve as it is
    ckpt = CheckpointManager(run_dir / "checkpoints", t.max_ckpts_to_keep, tokenizer_from=model_dir)
    # a resume that changes the data order is refused here, before anything starts
    resume_from, state = await _read_resume_state(cfg, ckpt, strategy.order)
    return Prepared(
        generator_cls=generator_cls,
        model_dir=model_dir,
        tokenizer=tokenizer,
        reward_fn=data.reward_fn,
        fitted=(train, evals),
        strategy=strategy,
        last_step=last_step,
        ckpt=ckpt,
        resume_from=resume_from,
        state=state,
    )


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
                "resume_mode=%s but no checkpoint under %s: starting from step 1 (the lines "
                "of a run that ended before its first checkpoint are replaced)",
                t.resume_mode,
                ckpt.root,
            )
        return None, {}
    state = await trio.to_thread.run_sync(ckpt.read_trainer_state, resume_from)
    order.load_state_dict(state["loader"])
    return resume_from, state
