"""Forty bad configuration values, each refused by ``python -m trainer`` in one line
(``ConfigError: ...``, ``DataError: ...`` for a data file), with exit status 2, before anything is written: no run folder, no
``train.log``, no ``config.yaml``, nothing in the working directory.

They run in this process through the CLI's entry function (forty interpreters would cost
minutes); two of them also as real subprocesses.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.__main__ import main

#: The one line of a refusal (DESIGN 4.4): a bad data file is a DataError, the rest ConfigError.
REFUSAL = re.compile(r"(ConfigError|DataError): \S")

#: Cheap parts, so that a value refused only at start-up (generator.cls) is refused quickly.
BASE = ["engine.backend=inprocess", "trainer.progress=false"]

BAD = [
    # wrong types
    "trainer.max_steps=ten",
    "trainer.train_batch_size=2.5",
    "trainer.progress=maybe",
    "engine.urls=42",
    "generator.kwargs=7",
    "trainer.seed=[1,2]",
    # negatives, zero, NaN, inf
    "trainer.max_steps=-1",
    "trainer.train_batch_size=0",
    "data.reward_workers=-3",
    "generator.sampling.temperature=nan",
    "generator.sampling.top_p=inf",
    "trainer.step_timeout_s=-inf",
    "algorithm.kl_coef=nan",
    "engine.gpu_memory_utilization=1.5",
    "data.digits=10",
    # empty strings and empty overrides
    "trainer.run_dir=",
    "trainer.run_dir=''",
    "generator.cls=''",
    "model.path=",
    # unknown enum values and unknown keys
    "trainer.strategy=async",
    "engine.backend=tensorrt",
    "trainer.resume_mode=earliest",
    "trainer.max_step=10",
    "nosuch.section.key=1",
    "+trainer.extra=1",
    "trainer=3",
    # out-of-bound resources
    "engine.backend=local engine.num_engines=100000",
    "data.reward_workers=100000",
    "engine.max_concurrency=100000000",
    "generator.num_parallel_workers=1000000",
    "trainer.max_processes_per_core=0",
    # contradictory combinations
    "engine.backend=remote",
    "trainer.resume_mode=path",
    "workers.num_policy_workers=2",
    "trainer.policy_mini_batch_size=3",
    # bad paths
    "trainer.run_dir=/dev/null",
    "data.train=/nonexistent/train.jsonl",
    # a bad faults spec, a bad generator class
    "faults=explode@nowhere",
    "generator.cls=os:system",
    "generator.cls=no colon",
]


def test_there_are_forty_distinct_bad_values():
    assert len(BAD) == len(set(BAD)) == 40


@pytest.mark.parametrize("override", BAD)
def test_a_bad_value_is_refused_in_one_line_with_status_2_and_nothing_written(
    tmp_path, monkeypatch, capsys, override
):
    monkeypatch.chdir(tmp_path)
    argv = [*BASE, f"trainer.run_dir={tmp_path / 'run'}", *override.split(" ")]
    status = main(argv)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if not line.startswith("warning: ")]
    assert status == 2, err
    assert len(lines) == 1 and REFUSAL.match(lines[0]), err
    assert list(tmp_path.iterdir()) == [], err  # no run folder, train.log or config.yaml


@pytest.mark.parametrize(
    "override", ["engine.backend=local engine.num_engines=100000", "generator.cls=os:system"]
)
def test_a_bad_value_is_refused_the_same_way_by_a_real_process(tmp_path, override):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer",
            *BASE,
            f"trainer.run_dir={tmp_path / 'run'}",
            *override.split(" "),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert REFUSAL.match(done.stderr.strip().splitlines()[-1]), done.stderr
    assert list(Path(tmp_path).iterdir()) == []
