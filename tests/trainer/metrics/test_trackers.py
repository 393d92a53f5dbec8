"""Trackers beside metrics.jsonl: TensorBoard and offline wandb runs write what the run logged,
read back here from their own files; MLflow too where it is installed."""

from __future__ import annotations

import json
import logging
import struct
import sys
import typing
from pathlib import Path

import pytest

import trainer.run
from trainer.config import load_config
from trainer.config._schema import TrainerConfig
from trainer.errors import ConfigError
from trainer.metrics._trackers import LOGGERS, TensorBoardTracker, open_trackers

RUN = [
    "engine.backend=inprocess",
    "trainer.max_steps=2",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "trainer.progress=false",
    "data.reward_fn=tests.trainer.helpers:varied_reward",
]
KEYS = ("reward/mean", "policy/loss", "policy/grad_norm", "timing/step")


def _jsonl(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {k: [(r["step"], r[k]) for r in rows if k in r] for k in KEYS}


def _tensorboard(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {k: [(e.step, e.value) for e in events.Scalars(k)] for k in KEYS}


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (a LevelDB-style log of 32 KiB blocks)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending + chunk)
            pending = b""
            yield record
        elif kind in (2, 3):  # its first or a middle piece
            pending += chunk


def _wandb(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history: dict[str, list[tuple[int, float]]] = {k: [] for k in KEYS}
    config: dict[str, str] = {}
    for record in _wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {
                i.key or "/".join(i.nested_key): json.loads(i.value_json)
                for i in record.history.item
            }
            for k in KEYS:
                if k in items:
                    history[k].append((items["_step"], items[k]))
        elif kind == "run":  # the run's start: its configuration
            config |= {i.key: i.value_json for i in record.run.config.update}
    return history, config


async def test_tensorboard_and_offline_wandb_hold_what_metrics_jsonl_holds(tmp_path):
    run_dir = tmp_path / "run"
    await trainer.run.train(
        load_config(
            None,
            [*RUN, f"trainer.run_dir={run_dir}", "trainer.loggers=[jsonl,tensorboard,wandb]"],
        )
    )
    logged = _jsonl(run_dir)
    assert [s for s, _ in logged["reward/mean"]] == [1, 2]
    for name, got in [
        ("tensorboard", _tensorboard(run_dir / "tensorboard")),
        ("wandb", _wandb(run_dir)[0]),
    ]:
        for key in KEYS:
            assert [s for s, _ in got[key]] == [s for s, _ in logged[key]], (name, key)
            assert [v for _, v in got[key]] == pytest.approx(
                [v for _, v in logged[key]], rel=1e-6
            ), (name, key)
    _, config = _wandb(run_dir)
    assert json.loads(config["trainer"])["max_steps"] == 2  # the run's configuration
    assert "startup: trackers ready in " in (run_dir / "train.log").read_text()


async def test_mlflow_records_the_metrics_and_the_configuration(tmp_path):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    async with open_trackers(
        ("jsonl", "mlflow"),
        tmp_path,
        project="proj",
        run_name="r1",
        mlflow_tracking_uri=uri,
        config={"trainer": {"seed": 3}},
    ) as sink:
        sink.log({"step": 1, "reward/mean": 0.5, "data/example_index": [1, 2], "x": None})
        sink.log({"step": 2, "reward/mean": 0.75, "checkpoint/path": "somewhere"})
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(1, 0.5), (2, 0.75)]
    assert set(run.data.metrics) == {"reward/mean"}  # numbers only
    assert run.data.params["trainer.seed"] == "3"


async def test_a_missing_library_is_a_config_error_naming_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ConfigError, match=r"install it with: pip install 'trainer\[wandb\]'"):
        async with open_trackers(("jsonl", "wandb"), tmp_path, project="p", run_name="r"):
            pass


async def test_a_tracker_that_fails_is_dropped_and_the_run_goes_on(tmp_path, monkeypatch, caplog):
    def fail(self, step, values):
        raise OSError("disk full")

    monkeypatch.setattr(TensorBoardTracker, "log", fail)
    with caplog.at_level(logging.WARNING, logger="trainer.metrics"):
        async with open_trackers(
            ("jsonl", "tensorboard"), tmp_path, project="p", run_name="r"
        ) as sink:
            sink.log({"step": 1, "reward/mean": 0.5})
            sink.log({"step": 2, "reward/mean": 0.5})
    assert [r.message for r in caplog.records] == [
        "tracker tensorboard failed; dropped (metrics.jsonl goes on)"
    ]


def test_the_loggers_are_the_ones_the_schema_allows():
    item_type = typing.get_args(typing.get_type_hints(TrainerConfig)["loggers"])[0]
    assert typing.get_args(item_type) == LOGGERS
