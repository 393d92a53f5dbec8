"""Experiment trackers beside ``metrics.jsonl``: TensorBoard, Weights & Biases, MLflow.

``trainer.loggers`` names where each step's metrics go. ``jsonl`` (``RUN_DIR/metrics.jsonl``,
written by :class:`trainer.metrics._logger.MetricsLogger`) is always among them: it is the run's
record, which resume, ``plot`` and the summary read. The others are optional extras of the
package, imported only when named:

============  ==================================  ==========================================
logger        install                             writes
============  ==================================  ==========================================
tensorboard   ``pip install 'trainer[tensorboard]'``  ``RUN_DIR/tensorboard/events.out.tfevents.*``
wandb         ``pip install 'trainer[wandb]'``    ``RUN_DIR/wandb/`` (``trainer.wandb_mode``,
                                                  offline by default: no network, no account)
mlflow        ``pip install 'trainer[mlflow]'``   a run in ``trainer.mlflow_tracking_uri``
                                                  (default ``sqlite:///RUN_DIR/mlflow.db``)
============  ==================================  ==========================================

Each tracker gets the numbers of every row at the row's step (lists such as
``data/example_index`` and strings such as ``checkpoint/path`` stay in ``metrics.jsonl``),
and the run's configuration as its parameters. A resumed run is a new tracker run with the
same name; ``metrics.jsonl`` is the one continuous record.

Nothing of it runs on the trio thread: :func:`open_trackers` starts the trackers in a
worker thread, and :meth:`TrackerSink.log` only queues a row, which a task of its own
nursery hands to that thread, one row after the other, in order. A tracker that fails to
start fails the run before it starts anything else (a missing library is a ``ConfigError``
naming the extra to install); one that fails later is logged and dropped, and training goes
on.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, Protocol

import attrs
import trio

from trainer.errors import ConfigError
from trainer.vocabulary import open_owner_nursery

__all__ = [
    "CLOSE_TIMEOUT_S",
    "LOGGERS",
    "MlflowTracker",
    "TensorBoardTracker",
    "Tracker",
    "TrackerSink",
    "WandbTracker",
    "open_trackers",
    "scalars",
]

log = logging.getLogger("trainer.metrics")

#: The allowed values of ``trainer.loggers``.
LOGGERS: tuple[str, ...] = ("jsonl", "tensorboard", "wandb", "mlflow")
#: How long closing the trackers (writing what is queued, wandb's ``finish``) may take.
CLOSE_TIMEOUT_S = 60.0

WandbMode = Literal["offline", "online"]


class Tracker(Protocol):
    """One tracker; every method blocks (it runs in the trackers' worker thread)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalars(row: Mapping[str, object]) -> dict[str, float]:
    """The numbers of a ``metrics.jsonl`` row, as floats: ``step`` itself, lists, strings,
    ``None`` (a non-finite number) left out."""
    return {
        k: float(v)
        for k, v in row.items()
        if k != "step" and isinstance(v, int | float) and not isinstance(v, bool)
        if math.isfinite(v)
    }


def _flat(config: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out |= _flat(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


class TensorBoardTracker:
    """Scalars into ``log_dir`` through ``torch.utils.tensorboard`` (needs ``tensorboard``)."""

    def __init__(self, log_dir: Path, config: dict[str, object]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir))
        text = "\n".join(f"    {k}: {v!r}" for k, v in _flat(config).items())
        self._writer.add_text("config", text, 0)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """A Weights & Biases run under ``run_dir/wandb`` (``mode="offline"``: no network)."""

    def __init__(
        self, run_dir: Path, *, project: str, name: str, mode: WandbMode, config: dict[str, object]
    ) -> None:
        import wandb

        # console="off": wandb must not wrap stdout/stderr (the progress display owns them)
        self._run = wandb.init(
            project=project,
            name=name,
            dir=str(run_dir),
            mode=mode,
            config=config,
            settings=wandb.Settings(console="off", quiet=True, silent=True),
        )

    def log(self, step: int, values: dict[str, float]) -> None:
        self._run.log(values, step=step)

    def close(self) -> None:
        """Finish the run and stop wandb's service process (nothing of the run outlives it)."""
        import wandb

        self._run.finish()
        wandb.teardown()


class MlflowTracker:
    """An MLflow run in experiment ``experiment`` at ``tracking_uri``."""

    def __init__(
        self, tracking_uri: str, *, experiment: str, name: str, config: dict[str, object]
    ) -> None:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # not its INFO lines on stderr
        self._client = MlflowClient(tracking_uri)
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found else self._client.create_experiment(experiment)
        self._run_id = self._client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k, str(v)[:6000]) for k, v in _flat(config).items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self._client.log_batch(self._run_id, params=params[i : i + 100])

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        self._client.log_batch(self._run_id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._run_id)


@attrs.define(eq=False)
class TrackerSink:
    """Where the loop puts each row for the trackers; :meth:`log` never blocks."""

    _send: trio.MemorySendChannel[dict[str, Any]] | None = None

    def log(self, row: dict[str, Any]) -> None:
        """Queue ``row`` (a ``metrics.jsonl`` row with its ``step``) for every tracker."""
        if self._send is not None:
            self._send.send_nowait(row)


def _factory(
    name: str,
    run_dir: Path,
    *,
    project: str,
    run_name: str,
    wandb_mode: WandbMode,
    mlflow_tracking_uri: str | None,
    config: dict[str, object],
) -> Callable[[], Tracker]:
    if name == "tensorboard":
        return lambda: TensorBoardTracker(run_dir / "tensorboard", config)
    if name == "wandb":
        return lambda: WandbTracker(
            run_dir, project=project, name=run_name, mode=wandb_mode, config=config
        )
    if name == "mlflow":
        uri = (
            mlflow_tracking_uri
            or os.environ.get("MLFLOW_TRACKING_URI")
            or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
        )
        return lambda: MlflowTracker(uri, experiment=project, name=run_name, config=config)
    raise ValueError(f"unknown logger {name!r}; allowed: {', '.join(LOGGERS)}")


def _start(name: str, factory: Callable[[], Tracker]) -> Tracker:
    try:
        return factory()
    except ImportError as exc:
        raise ConfigError(
            f"config: trainer.loggers names {name!r}, but its library is not installed "
            f"({exc}); install it with: pip install 'trainer[{name}]'"
        ) from None


async def _forward(
    receive: trio.MemoryReceiveChannel[dict[str, Any]],
    trackers: dict[str, Tracker],
    limiter: trio.CapacityLimiter,
) -> None:
    """Hand each queued row to every tracker, in the trackers' thread; drop one that fails."""

    def log_row(row: dict[str, Any]) -> None:
        values = scalars(row)
        for name, tracker in list(trackers.items()):
            try:
                tracker.log(int(row["step"]), values)
            except Exception:
                log.warning(
                    "tracker %s failed; dropped (metrics.jsonl goes on)", name, exc_info=True
                )
                del trackers[name]

    async with receive:
        async for row in receive:
            await trio.to_thread.run_sync(log_row, row, limiter=limiter)


def _close_all(trackers: dict[str, Tracker]) -> None:
    for name, tracker in trackers.items():
        try:
            tracker.close()
        except Exception:
            log.warning("closing tracker %s failed", name, exc_info=True)


@asynccontextmanager
async def open_trackers(
    loggers: tuple[str, ...],
    run_dir: Path,
    *,
    project: str,
    run_name: str,
    wandb_mode: WandbMode = "offline",
    mlflow_tracking_uri: str | None = None,
    config: dict[str, object] | None = None,
) -> AsyncIterator[TrackerSink]:
    """Start the trackers ``loggers`` names (``jsonl`` is not one: ``MetricsLogger`` writes it).

    Yields the sink the loop logs rows to. Start-up runs in a thread; a ``ConfigError`` for
    a missing library, or any error of a tracker's start, propagates after the trackers
    already started are closed. When the block exits, the rows still queued are written
    (unless the block is cancelled: then they are dropped) and every tracker is closed, in a
    shielded scope bounded by :data:`CLOSE_TIMEOUT_S` (a warning when it is cut off).
    """
    names = [n for n in loggers if n != "jsonl"]
    if not names:
        yield TrackerSink()
        return
    limiter = trio.CapacityLimiter(1)  # one thread at a time: rows stay in order
    trackers: dict[str, Tracker] = {}
    try:
        for name in names:
            factory = _factory(
                name,
                run_dir,
                project=project,
                run_name=run_name,
                wandb_mode=wandb_mode,
                mlflow_tracking_uri=mlflow_tracking_uri,
                config=config or {},
            )
            trackers[name] = await trio.to_thread.run_sync(
                _start, name, factory, limiter=limiter, thread_name=f"tracker:{name}"
            )
        send, receive = trio.open_memory_channel[dict[str, Any]](math.inf)
        async with open_owner_nursery() as nursery:  # the run's error comes out unwrapped
            nursery.start_soon(_forward, receive, trackers, limiter)
            with send:
                yield TrackerSink(send)
    finally:
        with trio.move_on_after(CLOSE_TIMEOUT_S, shield=True) as scope:
            await trio.to_thread.run_sync(
                _close_all, trackers, limiter=limiter, abandon_on_cancel=True
            )
        if scope.cancelled_caught:
            log.warning("closing the trackers did not finish in %.0fs", CLOSE_TIMEOUT_S)
