"""Resuming from a run's own ``config.yaml``, and refusing a resume that changes the data order."""

from __future__ import annotations

import json
import shutil

import pytest

import trainer.run
from tests.trainer.helpers import EngineVersions
from trainer.config import load_config
from trainer.errors import ConfigError

SMALL = [
    "engine.backend=inprocess",
    "generator.cls=tests.trainer.helpers:OneCallGenerator",
    "trainer.train_batch_size=2",
    "generator.n_samples_per_prompt=2",
    "generator.sampling.max_tokens=2",
    "trainer.ckpt_interval=1",
    "trainer.progress=false",
]


def _steps(run_dir) -> list[int]:
    return [
        json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()
    ]


async def test_a_run_without_run_dir_resumes_from_its_config_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    await trainer.run.train(load_config(None, [*SMALL, "trainer.max_steps=2"]))
    (run_dir,) = (tmp_path / "runs").iterdir()  # runs/<timestamp>, chosen by the run
    recorded = run_dir / "config.yaml"
    # only the file and the resume switch: every other override comes back from the file
    cfg = load_config(recorded, ["trainer.resume_mode=latest", "trainer.max_steps=3"])
    assert cfg.trainer.run_dir == str(run_dir.relative_to(tmp_path))
    await trainer.run.train(cfg)
    assert _steps(run_dir) == [1, 2, 3]
    assert "resumed from" in (run_dir / "train.log").read_text()


async def test_a_resume_with_another_seed_stops_before_any_step(tmp_path):
    common = [*SMALL, f"trainer.run_dir={tmp_path}"]
    await trainer.run.train(load_config(None, [*common, "trainer.max_steps=1"]))
    changed = load_config(
        None, [*common, "trainer.max_steps=2", "trainer.seed=7", "trainer.resume_mode=latest"]
    )
    with pytest.raises(
        ConfigError, match=r"trainer\.seed differs from the checkpoint's \(7 here, 0"
    ):
        await trainer.run.train(changed)
    assert _steps(tmp_path) == [1]


async def test_a_fresh_run_into_a_finished_runs_directory_is_refused_before_it_starts(
    tmp_path, monkeypatch
):
    """Run twice with the same ``trainer.run_dir`` and no resume: the second is refused at once
    (nothing loaded, the first run's files as they were) instead of appending its steps."""
    common = [*SMALL, f"trainer.run_dir={tmp_path}", "trainer.max_steps=1"]
    await trainer.run.train(load_config(None, common))
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    loaded: list[object] = []
    monkeypatch.setattr("trainer.run._prepare.resolve_model_path", loaded.append)
    with pytest.raises(ConfigError, match=r"already holds a run \(1 lines.*resume_mode=latest"):
        await trainer.run.train(load_config(None, common))
    assert loaded == []
    assert {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()} == before
    monkeypatch.undo()
    await trainer.run.train(load_config(None, [*common, "trainer.resume_mode=latest"]))


async def test_a_run_without_checkpoints_is_neither_overwritten_nor_resumed_from_nothing(
    tmp_path,
):
    """The default run saves no checkpoint: advising resume_mode=latest would start afresh and
    replace its metrics. Both a fresh run and a resume there are refused, the record kept."""
    common = [*SMALL, f"trainer.run_dir={tmp_path}", "trainer.max_steps=1"]
    await trainer.run.train(load_config(None, [*common, "trainer.ckpt_interval=0"]))
    before = (tmp_path / "metrics.jsonl").read_text()
    for mode, said in (("none", "it saved no checkpoint"), ("latest", "found no checkpoint of it")):
        with pytest.raises(ConfigError, match=rf"{said} .*give a new trainer.run_dir") as info:
            await trainer.run.train(load_config(None, [*common, f"trainer.resume_mode={mode}"]))
        assert "resume_mode=latest, or" not in str(info.value)
    assert (tmp_path / "metrics.jsonl").read_text() == before


async def test_a_run_killed_before_its_first_checkpoint_is_relaunched_from_step_1(tmp_path, caplog):
    """A scheduler relaunching a preempted run with resume_mode=latest: where the run saves
    checkpoints but died before its first (no checkpoint, no summary.json), it starts again
    from step 1, as a resume drops the lines after its checkpoint; not refused."""
    common = [*SMALL, f"trainer.run_dir={tmp_path}", "trainer.max_steps=1"]
    await trainer.run.train(load_config(None, common))
    shutil.rmtree(tmp_path / "checkpoints")  # what a kill before the first one leaves
    (tmp_path / "summary.json").unlink()
    relaunched = [*common, "trainer.max_steps=2", "trainer.resume_mode=latest"]
    await trainer.run.train(load_config(None, relaunched))
    assert _steps(tmp_path) == [1, 2]
    assert "no checkpoint under" in caplog.text and "starting from step 1" in caplog.text


async def test_a_refused_resume_leaves_config_yaml_as_the_run_recorded_it(tmp_path):
    recorded = tmp_path / "config.yaml"
    await trainer.run.train(
        load_config(None, [*SMALL, f"trainer.run_dir={tmp_path}", "trainer.max_steps=1"])
    )
    before = recorded.read_text()
    refused = load_config(recorded, ["trainer.resume_mode=latest", "trainer.seed=1"])
    with pytest.raises(ConfigError, match=r"trainer\.seed differs"):
        await trainer.run.train(refused)
    assert recorded.read_text() == before
    # so the error's own advice works next: resume with the recorded file
    await trainer.run.train(
        load_config(recorded, ["trainer.resume_mode=latest", "trainer.max_steps=2"])
    )
    assert _steps(tmp_path) == [1, 2]
    assert "max_steps: 2" in recorded.read_text()  # an accepted resume records its config


async def test_a_resume_restores_the_checkpointed_steps_line_and_drops_a_torn_one(tmp_path):
    common = [*SMALL, f"trainer.run_dir={tmp_path}"]
    await trainer.run.train(load_config(None, [*common, "trainer.max_steps=1"]))
    metrics = tmp_path / "metrics.jsonl"
    (logged,) = [json.loads(line) for line in metrics.read_text().splitlines()]
    # as a run SIGKILLed after step 1's checkpoint, while writing step 1's line, leaves it
    metrics.write_text('{"step": 1, "reward/me')
    await trainer.run.train(
        load_config(None, [*common, "trainer.max_steps=2", "trainer.resume_mode=latest"])
    )
    assert _steps(tmp_path) == [1, 2]
    restored = json.loads(metrics.read_text().splitlines()[0])
    assert restored["reward/mean"] == logged["reward/mean"]
    assert restored["policy/loss"] == logged["policy/loss"]
    log = (tmp_path / "train.log").read_text()
    assert "dropping a torn line" in log and "restored from its checkpoint" in log


async def test_a_resumed_runs_new_engine_serves_the_trainers_weight_version(tmp_path):
    """A resumed run starts a new reference server, whose own count of loads starts at 0; the
    trainer's count goes on from the checkpoint's, and every sync's ``/finish_weight_update``
    names it, so both report the same version (the engine would say 1 at step 3 otherwise)."""
    common = [
        *SMALL,
        "engine.backend=local",
        "generator.cls=tests.trainer.helpers:EngineVersions",
        f"trainer.run_dir={tmp_path}",
    ]
    EngineVersions.seen.clear()
    await trainer.run.train(load_config(None, [*common, "trainer.max_steps=2"]))
    resumed = [*common, "trainer.max_steps=3", "trainer.resume_mode=latest"]
    await trainer.run.train(load_config(None, resumed))
    assert _steps(tmp_path) == [1, 2, 3]
    # the first sync makes version 1; the checkpoint of step 2 was saved before its sync
    assert EngineVersions.seen == [(1, 1), (2, 2), (3, 3)]


async def test_a_resume_of_a_finished_run_starts_nothing_and_says_so(tmp_path, monkeypatch, caplog):
    """Resumed at its last step (a finished run, re-launched): no engine or worker starts, the
    run's files stay as they were, and its summary comes back."""
    common = [*SMALL, f"trainer.run_dir={tmp_path}", "trainer.max_steps=2"]
    first = await trainer.run.train(load_config(None, common))
    before = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}

    def no_engines(*args: object, **kwargs: object) -> None:
        raise AssertionError("an engine was started")

    monkeypatch.setattr("trainer.run._train.open_engines", no_engines)
    again = await trainer.run.train(load_config(None, [*common, "trainer.resume_mode=latest"]))
    assert again == first
    assert "nothing to train" in caplog.text and "raise trainer.max_steps" in caplog.text
    after = {f.name: f.read_bytes() for f in tmp_path.iterdir() if f.is_file()}
    assert {k: v for k, v in after.items() if k != "train.log"} == {
        k: v for k, v in before.items() if k != "train.log"
    }
    # a summary.json from an earlier end (the run resumed once more, then died before writing
    # its own) is not returned for this checkpoint's step: the summary is made again
    stale = {**first, "last_step": 1}
    (tmp_path / "summary.json").write_text(json.dumps(stale))
    again = await trainer.run.train(load_config(None, [*common, "trainer.resume_mode=latest"]))
    assert again["last_step"] == 2 and again["reward/last_20pct"] == first["reward/last_20pct"]
