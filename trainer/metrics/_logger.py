"""Where a run's numbers go: ``metrics.jsonl``, the run log, and the live progress display."""

from __future__ import annotations

import json
import logging
import logging.handlers
import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import TracebackType
from typing import Any, TypedDict

from rich.console import Console, Group
from rich.live import Live
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

from trainer.metrics._repeats import RepeatedWarnings

__all__ = [
    "ETA_WINDOW",
    "KL_METRICS",
    "ONE_UPDATE_METRICS",
    "MetricsLogger",
    "StepProgress",
    "eval_line",
    "jsonable_row",
    "open_run_log",
    "restore_metrics",
    "setup_run_logging",
    "teardown_run_logging",
]

log = logging.getLogger("trainer")
LOGGERS = ("trainer", "engines", "sync", "py.warnings")


#: The mode of the files a run writes in its folder (``train.log``, ``metrics.jsonl``).
PRIVATE_FILE_MODE = 0o600


def _private_opener(path: str, flags: int) -> int:
    """``open``'s opener for a run's own files: made with mode 0600 (an existing file keeps
    its mode)."""
    return os.open(path, flags, PRIVATE_FILE_MODE)


def setup_run_logging(run_dir: Path | None = None) -> list[logging.Handler]:
    """Send our loggers (and warnings) to ``RUN_DIR/train.log`` (mode 0600); warnings also to
    stderr.

    Without ``run_dir`` (a run not accepted yet, whose folder must not exist until it is) the
    records are held in memory until :func:`open_run_log` writes them to ``train.log`` first;
    a run refused before that leaves no file, and its records are dropped by
    :func:`teardown_run_logging` (the refusal itself is the CLI's last line).
    """
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    console.addFilter(RepeatedWarnings(console))  # a warning again and again: counted
    first: logging.Handler = (
        _file_handler(run_dir)
        if run_dir is not None
        else logging.handlers.MemoryHandler(capacity=1 << 20, flushLevel=logging.CRITICAL + 1)
    )
    handlers: list[logging.Handler] = [first, console]
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for h in handlers:
            logger.addHandler(h)
        logger.setLevel(logging.INFO)
    logging.captureWarnings(True)
    return handlers


def _file_handler(run_dir: Path) -> logging.Handler:
    path = run_dir / "train.log"
    os.close(_private_opener(str(path), os.O_WRONLY | os.O_CREAT | os.O_APPEND))  # made 0600
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    return handler


def open_run_log(handlers: list[logging.Handler], run_dir: Path) -> None:
    """Once the run is accepted and ``run_dir`` made: ``train.log`` opened, the records held
    since :func:`setup_run_logging` written to it first, and it takes their place in
    ``handlers`` (so :func:`teardown_run_logging` closes it). A no-op where ``handlers``
    already write a file. Blocking (it opens the file)."""
    held = handlers[0]
    if not isinstance(held, logging.handlers.MemoryHandler):
        return
    file_handler = _file_handler(run_dir)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(file_handler)
        logger.removeHandler(held)
    held.setTarget(file_handler)
    held.close()  # flushes the held records into train.log, in order
    handlers[0] = file_handler


def teardown_run_logging(handlers: list[logging.Handler]) -> None:
    for h in handlers:  # each repeated warning's count, before the console goes
        for f in h.filters:
            if isinstance(f, RepeatedWarnings):
                f.close()
    for name in LOGGERS:
        for h in handlers:
            logging.getLogger(name).removeHandler(h)
    for h in handlers:
        if isinstance(h, logging.handlers.MemoryHandler) and h.target is None:
            h.buffer.clear()  # a run refused before its folder existed: nothing to write
        h.close()
    logging.captureWarnings(False)


def jsonable_row(metrics: Mapping[str, object]) -> dict[str, object]:
    """``metrics`` as strict JSON takes it: a non-finite float (``nan``, ``inf``) becomes None."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()
    }


def restore_metrics(
    path: Path, step: int, checkpoint_row: Mapping[str, object] | None = None
) -> None:
    """Make ``metrics.jsonl`` hold steps up to ``step`` only, as a resume from ``step`` needs.

    Lines of later steps are dropped (they run again); so is a line that is not JSON (the
    torn last line of a run killed while writing it), with a warning. If no line of ``step``
    itself is left and ``checkpoint_row`` (the step's metrics as its checkpoint saved them)
    is given, it is appended: a run killed between its checkpoint save and the end of the
    step leaves no gap. The file is replaced atomically, so a run killed here leaves it as
    it was. Blocking (a small file).
    """
    if not path.exists() and checkpoint_row is None:
        return
    kept: list[str] = []
    logged: set[int] = set()
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row_step = int(json.loads(line).get("step", 0))
        except ValueError:
            log.warning("dropping a torn line of %s: %r", path, line[:80])
            continue
        if row_step <= step:
            kept.append(line)
            logged.add(row_step)
    if checkpoint_row is not None and step not in logged:
        log.info(
            "step %d's metrics restored from its checkpoint (the run stopped before it logged them)",
            step,
        )
        kept.append(json.dumps({**checkpoint_row, "step": step}))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8", opener=_private_opener) as f:
        f.write("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``, flushed after each line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = open(path, "a", encoding="utf-8", opener=_private_opener)  # noqa: SIM115

    def log(self, metrics: Mapping[str, object]) -> None:
        self._file.write(json.dumps(jsonable_row(metrics)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


#: The KL the step bar shows and ``plot`` draws, the first a step has: the KL penalty to the
#: reference model (``algorithm.use_kl_loss=true``), else the approximate KL to the policy
#: that generated the rollouts.
KL_METRICS: tuple[str, ...] = ("policy/kl", "policy/approx_kl")
#: What the step bar shows instead where every batch gets one optimizer step (the default:
#: ``trainer.policy_mini_batch_size`` unset, ``trainer.update_epochs=1``). There the policy
#: that scored the batch is the one that trains on it, so ``policy/approx_kl`` is 0 on every
#: step; the gradient norm says instead how large the update was.
ONE_UPDATE_METRICS: tuple[str, ...] = ("policy/kl", "policy/grad_norm")
#: How many of the latest step times the ETA takes the median of.
ETA_WINDOW = 10


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _kl(metrics: dict[str, Any], keys: tuple[str, ...]) -> tuple[str, float | None]:
    for key in keys:
        if metrics.get(key) is not None:
            return key.removeprefix("policy/"), metrics[key]
    return "kl", None


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


class _StepFields(TypedDict):
    """The step bar's columns, as shown."""

    eta: str
    reward: str
    loss: str
    kl: str
    step_s: str


#: Where stderr is no terminal, a start-up phase that still runs says so this often.
STILL_EVERY_S = 15.0


class StepProgress:
    """The live display on stderr: each start-up phase with its time, then the step bar.

    On a terminal (rich): a line per start-up phase with a spinner and the time it has taken
    so far, kept with its final time when the phase ends; then a bar with the step, the ETA,
    reward, loss, KL and step time. Elsewhere (CI, a pipe): plain lines, ``startup: engines
    ...`` when a phase begins, ``startup: engines ... 15s so far`` every :data:`STILL_EVERY_S`
    while it runs, ``startup: engines ready in 3.1s`` when it ends, and one line per step. Disabled (``trainer.progress=false``): nothing on stderr. ``train.log`` gets
    each phase's time either way. ``console`` (default: stderr) decides which it is. With
    ``one_update_per_batch`` the KL column shows :data:`ONE_UPDATE_METRICS` (the gradient
    norm where there is no KL penalty), else :data:`KL_METRICS`.

    Usage::

        with StepProgress(enabled=cfg.trainer.progress) as progress:
            with progress.phase("engines"):
                ...  # start them
            progress.start_steps(total=200, start=0)
            progress.update(1, {"reward/mean": 0.1, "policy/loss": 0.3, "timing/step": 1.2})

    The ETA is the median of the latest :data:`ETA_WINDOW` step times of this process, times
    the steps left, from its second step on (``-`` until then): a process's first step carries
    first-use costs (0.12 s against a median of 0.09 s for the default run, 0.20 s against 0.16 s
    through vLLM, 2026-12-05), and one step is no estimate: a slow first step on a busy machine
    showed an ETA of 7:55 for a run that took 30 s. The median, so that one slow step does not
    move it either.
    """

    def __init__(
        self,
        *,
        enabled: bool = True,
        console: Console | None = None,
        one_update_per_batch: bool = False,
    ) -> None:
        self.console = console or Console(stderr=True)
        self._kl_keys = ONE_UPDATE_METRICS if one_update_per_batch else KL_METRICS
        self.enabled = enabled and self.console.is_terminal
        self.plain = enabled and not self.console.is_terminal
        self._phases = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("startup: {task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._steps = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("ETA {task.fields[eta]}"),
            TextColumn("reward {task.fields[reward]}"),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[kl]}"),
            TextColumn("{task.fields[step_s]}s/step"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._evals = Progress(
            SpinnerColumn(finished_text="[green]✓"),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
            console=self.console,
        )
        self._live = Live(
            Group(self._phases, self._evals, self._steps),
            console=self.console,
            refresh_per_second=4,
            transient=False,
        )
        self._step_task: TaskID | None = None
        self._times: list[float] = []  # the latest step times, not this process's first
        self._first_step_done = False
        self.total = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """A start-up phase runs inside: shown while it runs, its time logged when it ends.

        On an error or a cancellation the phase is shown and logged as failed after its
        time, and the exception propagates.
        """
        started = time.monotonic()
        task = self._phases.add_task(name, total=1)
        if self.plain:
            print(f"startup: {name} ...", file=self.console.file, flush=True)
        try:
            with self._still_going(name, started):
                yield
        except BaseException:
            elapsed = time.monotonic() - started
            self._phases.update(task, description=f"{name} [red]failed", completed=1)
            log.info("startup: %s failed after %.2fs", name, elapsed)
            if self.plain:
                print(
                    f"startup: {name} failed after {elapsed:.1f}s",
                    file=self.console.file,
                    flush=True,
                )
            raise
        elapsed = time.monotonic() - started
        self._phases.update(task, completed=1)
        log.info("startup: %s ready in %.2fs", name, elapsed)
        if self.plain:
            print(f"startup: {name} ready in {elapsed:.1f}s", file=self.console.file, flush=True)

    @contextmanager
    def _still_going(self, name: str, started: float) -> Iterator[None]:
        """Plain lines only: every :data:`STILL_EVERY_S` of a phase, a line saying it still
        runs (a terminal shows its clock; a log would show nothing for a vLLM server's
        minute). A thread of its own, stopped and joined when the phase ends."""
        if not self.plain:
            yield
            return
        done = threading.Event()

        def tick() -> None:
            while not done.wait(STILL_EVERY_S):
                so_far = time.monotonic() - started
                # one write, so a log line from another thread cannot land inside it
                self.console.file.write(f"startup: {name} ... {so_far:.0f}s so far\n")
                self.console.file.flush()

        ticker = threading.Thread(target=tick, name=f"startup {name}", daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            # bounded: a write blocked on a full stderr pipe must not hold the caller (the
            # event loop's thread), and the thread is a daemon
            ticker.join(timeout=1.0)

    @contextmanager
    def evaluating(self, step: int) -> Iterator[dict[str, float]]:
        """An eval after ``step`` runs inside; the caller puts its metrics into the dict this
        yields. Shown while it runs (``eval at step N ...``) and, when it ends, its result
        (:func:`eval_line`) stays on the console: a terminal line with its time, elsewhere
        a plain line. On an error nothing more is shown (the error says it)."""
        result: dict[str, float] = {}
        name = f"eval at step {step}"
        task = self._evals.add_task(f"{name} ...", total=1)
        if self.plain:
            print(f"{name} ...", file=self.console.file, flush=True)
        yield result
        line = f"{name}: {eval_line(result)}"
        self._evals.update(task, description=line, completed=1)
        if self.plain:
            seconds = result.get("timing/eval")
            took = "" if seconds is None else f" in {seconds:.1f}s"
            print(f"{line}{took}", file=self.console.file, flush=True)

    def start_steps(self, total: int, *, start: int = 0) -> None:
        """Show the step bar: steps ``start + 1 .. total`` are to come."""
        self.total = total
        self._step_task = self._steps.add_task(
            "train",
            total=total,
            completed=start,
            eta="-",
            reward="-",
            loss="-",
            kl="kl -",
            step_s="-",
        )

    def update(self, step: int, metrics: dict[str, Any]) -> None:
        """Step ``step`` ended with ``metrics`` (its ``metrics.jsonl`` row)."""
        step_s = metrics.get("timing/step")
        if step_s is not None and self._first_step_done:
            self._times = [*self._times, step_s][-ETA_WINDOW:]
        self._first_step_done = self._first_step_done or step_s is not None
        left = self.total - step
        eta = statistics.median(self._times) * left if self._times else None
        if left == 0:
            eta = 0.0
        kl_name, kl = _kl(metrics, self._kl_keys)
        fields: _StepFields = {
            "eta": "-" if eta is None else _clock(eta),
            "reward": _num(metrics.get("reward/mean"), ".3f"),
            "loss": _num(metrics.get("policy/loss"), ".4f"),
            "kl": f"{kl_name} {_num(kl, '.4f')}",
            "step_s": _num(step_s, ".2f"),
        }
        if self._step_task is not None:
            self._steps.update(self._step_task, completed=step, **fields)
        if self.plain:  # not a terminal (CI, a pipe): one line per step
            print(
                f"step {step}/{self.total} reward {fields['reward']} loss {fields['loss']} "
                f"{fields['kl']} {fields['step_s']}s/step ETA {fields['eta']}",
                file=self.console.file,
                flush=True,
            )

    def __enter__(self) -> StepProgress:
        if self.enabled:
            self._live.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.enabled:
            self._live.__exit__(et, e, tb)


def eval_line(metrics: dict[str, float], *, compact: bool = False) -> str:
    """An eval's result in words: the greedy reward over the eval prompts and, where the eval
    sampled too, the sampled one (``eval/*`` metrics), each with its accuracy beside it where a
    partial-credit reward makes the two differ. ``compact``: without the word "reward" and the
    prompt count (the closing ``eval:`` line)."""
    line = f"greedy{'' if compact else ' reward'} {_scored(metrics, '')}"
    if "eval/sampled_reward_mean" in metrics:
        line += f", sampled {_scored(metrics, 'sampled_')}"
    prompts = metrics.get("eval/num_prompts")
    return line if prompts is None or compact else f"{line} ({int(prompts)} prompts)"


def _scored(metrics: dict[str, float], which: str) -> str:
    reward, accuracy = metrics.get(f"eval/{which}reward_mean"), metrics.get(f"eval/{which}accuracy")
    text = _num(reward, ".3f")
    if accuracy is not None and reward is not None and accuracy != reward:
        text += f" (accuracy {accuracy:.3f})"
    return text
