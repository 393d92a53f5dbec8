"""Where a run's numbers go: ``metrics.jsonl``, the run log, and the live progress display."""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = [
    "MetricsLogger",
    "StepProgress",
    "jsonable_row",
    "restore_metrics",
    "reward_summary",
    "setup_run_logging",
    "teardown_run_logging",
]

log = logging.getLogger("trainer")
LOGGERS = ("trainer", "engines", "sync", "py.warnings")


def setup_run_logging(run_dir: Path) -> list[logging.Handler]:
    """Send our loggers (and warnings) to ``RUN_DIR/train.log``; warnings also to stderr."""
    file_handler = logging.FileHandler(run_dir / "train.log", encoding="utf-8")
    file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    console = logging.StreamHandler(sys.stderr)
    console.setLevel(logging.WARNING)
    console.setFormatter(logging.Formatter("%(levelname)s: %(message)s"))
    handlers: list[logging.Handler] = [file_handler, console]
    for name in LOGGERS:
        logger = logging.getLogger(name)
        for h in handlers:
            logger.addHandler(h)
        logger.setLevel(logging.INFO)
    logging.captureWarnings(True)
    return handlers


def teardown_run_logging(handlers: list[logging.Handler]) -> None:
    for name in LOGGERS:
        for h in handlers:
            logging.getLogger(name).removeHandler(h)
    for h in handlers:
        h.close()
    logging.captureWarnings(False)


def jsonable_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` as strict JSON takes it: a non-finite float (``nan``, ``inf``) becomes None."""
    return {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in metrics.items()
    }


def restore_metrics(path: Path, step: int, checkpoint_row: dict[str, Any] | None = None) -> None:
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
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Appends one JSON object per step to ``metrics.jsonl``, flushed after each line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, Any]) -> None:
        self._file.write(json.dumps(jsonable_row(metrics)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class StepProgress:
    """A rich progress bar with step, reward and step time; quiet when disabled."""

    def __init__(self, total: int, *, start: int = 0, enabled: bool = True) -> None:
        self.console = Console(stderr=True)
        self.enabled = enabled and self.console.is_terminal
        self.plain = enabled and not self.console.is_terminal
        self._progress = Progress(
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("reward {task.fields[reward]:.3f}"),
            TextColumn("{task.fields[step_s]:.2f}s/step"),
            TimeElapsedColumn(),
            console=self.console,
            disable=not self.enabled,
        )
        self._task = self._progress.add_task(
            "train", total=total, completed=start, reward=0.0, step_s=0.0
        )
        self.total = total

    def update(self, step: int, reward: float, step_s: float) -> None:
        self._progress.update(self._task, completed=step, reward=reward, step_s=step_s)
        if self.plain:  # not a terminal (CI, a pipe): one line per step
            print(
                f"step {step}/{self.total} reward {reward:.3f} {step_s:.2f}s/step",
                file=sys.stderr,
                flush=True,
            )

    def __enter__(self) -> StepProgress:
        self._progress.__enter__()
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._progress.__exit__(et, e, tb)


def reward_summary(rewards: list[float]) -> dict[str, float]:
    """Mean reward of the first and last 20% of steps (at least one step each)."""
    if not rewards:
        return {}
    k = max(1, round(len(rewards) * 0.2))
    first = statistics.fmean(rewards[:k])
    last = statistics.fmean(rewards[-k:])
    return {"reward/first_20pct": first, "reward/last_20pct": last, "steps": float(len(rewards))}
