"""What a config starts is bounded at load by what the machine has, one line per refusal; the
defaults and the suite's own configs (several engines on two cores) pass."""

from __future__ import annotations

import attrs
import pytest

from trainer.config import load_config
from trainer.config._resources import RAY_CAP, check_resources
from trainer.errors import ConfigError


def _check(overrides: list[str], **machine: int | None) -> None:
    """``check_resources`` of ``overrides`` on a stand-in machine (the config is loaded on
    this one with the bound out of the way, then given its own back)."""
    per_core = [o for o in overrides if o.startswith("trainer.max_processes_per_core=")]
    cfg = load_config(None, [*overrides, "trainer.max_processes_per_core=1000000"])
    wanted = int(per_core[-1].split("=")[1]) if per_core else 8
    cfg = attrs.evolve(cfg, trainer=attrs.evolve(cfg.trainer, max_processes_per_core=wanted))
    check_resources(cfg, cfg.plan, **machine)


def test_the_defaults_and_the_suites_configs_pass_on_a_two_cpu_machine():
    for overrides in (
        [],
        ["engine.backend=local", "engine.num_engines=4", "data.reward_workers=4"],
        ["workers.backend=ray", "workers.num_policy_workers=4"],
    ):
        _check(overrides, cpus=2, gpus=0, open_files=1024)


def test_more_servers_than_the_cpus_hold_are_refused_unless_oversubscribed_on_purpose():
    with pytest.raises(ConfigError) as refused:
        _check(["engine.backend=local", "engine.num_engines=17"], cpus=2, open_files=None)
    assert str(refused.value) == (
        "config: engine.num_engines=17 is out of range: it starts 17 engine server processes "
        "on this machine, which has 2 usable CPUs, and the limit is 16 "
        "(trainer.max_processes_per_core=8 per CPU): lower it, or raise "
        "trainer.max_processes_per_core to oversubscribe on purpose"
    )
    overs = ["engine.backend=local", "engine.num_engines=17", "trainer.max_processes_per_core=9"]
    _check(overs, cpus=2, open_files=None)


def test_reward_workers_and_a_local_ray_clusters_actors_count_against_the_cpus():
    with pytest.raises(ConfigError, match=r"data.reward_workers=5 .* has 1 usable CPUs"):
        _check(["data.reward_workers=5", "trainer.max_processes_per_core=4"], cpus=1)
    with pytest.raises(ConfigError, match=r"workers.num_policy_workers=17 .* limit is 16"):
        _check(["workers.backend=ray", "workers.num_policy_workers=17"], cpus=2)
    # a cluster the run joins is not this machine's: only the absolute cap applies
    joined = ["workers.backend=ray", "workers.ray_address=auto", "workers.device=cpu"]
    _check([*joined, "workers.num_policy_workers=64"], cpus=2)
    with pytest.raises(ConfigError, match=f"at most {RAY_CAP}; lower it"):
        _check([*joined, f"workers.num_policy_workers={RAY_CAP + 1}"], cpus=2)


def test_requests_in_flight_are_bounded_by_the_open_file_limit():
    with pytest.raises(ConfigError, match=r"max_concurrency=2048 .* may open 1024 files"):
        _check(["engine.max_concurrency=2048"], open_files=1024)
    _check(["engine.max_concurrency=2048"], open_files=None)  # unlimited


def test_a_run_dir_that_cannot_be_made_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is not a folder"):
        load_config(None, [f"trainer.run_dir={tmp_path / 'file'}"])
    with pytest.raises(ConfigError, match=r"cannot be made: .*file is not a folder"):
        load_config(None, [f"trainer.run_dir={tmp_path / 'file' / 'run'}"])
