"""How the trainer shares a CPU-only machine's cores with the reference servers it starts."""

from __future__ import annotations

import pytest

from engines.launch import ReferenceServers
from trainer.config import load_config
from trainer.run._parts import CpuThreads, cpu_threads


@pytest.mark.parametrize(
    ("overrides", "cores", "expected"),
    [
        # sync: generation and training take turns, each gets every core in its turn
        ([], 2, CpuThreads(trainer=2, server=2)),
        (["engine.num_engines=2"], 8, CpuThreads(trainer=8, server=4)),
        (["engine.num_engines=4"], 2, CpuThreads(trainer=2, server=1)),
        # fully-async: both at once, one thread per server, the rest for the trainer
        (["trainer.strategy=fully_async"], 2, CpuThreads(trainer=1, server=1)),
        (["trainer.strategy=fully_async", "engine.num_engines=2"], 8, CpuThreads(6, 1)),
        (["trainer.strategy=fully_async", "engine.num_engines=4"], 2, CpuThreads(1, 1)),
        # servers the trainer does not start take no share
        (["trainer.strategy=fully_async", "engine.backend=inprocess"], 2, CpuThreads(2, 1)),
    ],
)
def test_the_cores_are_shared_by_strategy(overrides, cores, expected):
    assert cpu_threads(load_config(None, overrides), cores) == expected


def test_omp_num_threads_is_the_cores_to_share(monkeypatch):
    cfg = load_config(None, ["engine.num_engines=2"])
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert cpu_threads(cfg) == CpuThreads(trainer=4, server=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "nonsense")
    assert cpu_threads(cfg, cores=6) == CpuThreads(trainer=6, server=3)


def test_a_reference_server_is_started_with_its_threads():
    spec = ReferenceServers("m", num_threads=2)(0, "127.0.0.1")
    i = spec.argv.index("--num-threads")
    assert spec.argv[i + 1] == "2"
    assert "--num-threads" not in ReferenceServers("m")(0, "127.0.0.1").argv
