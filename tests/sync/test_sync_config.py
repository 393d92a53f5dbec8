"""The weight-sync config keys: defaults, the env var, and the combinations refused at load time."""

from __future__ import annotations

import pytest

from trainer.config import load_config
from trainer.errors import ConfigError


def test_group_init_timeout_defaults_to_600_and_the_env_var_sets_it(monkeypatch):
    monkeypatch.delenv("TRAINER_GROUP_INIT_TIMEOUT_S", raising=False)
    cfg = load_config(None, [])
    assert cfg.sync.group_init_timeout_s == 600.0
    assert cfg.sync.transport == "disk"
    assert (cfg.engine.colocated, cfg.engine.offload_kv_for_weight_sync) == (False, False)
    monkeypatch.setenv("TRAINER_GROUP_INIT_TIMEOUT_S", "7")
    assert load_config(None, []).sync.group_init_timeout_s == 7.0


@pytest.mark.parametrize("transport", ["gloo", "nccl", "ipc"])
def test_the_vllm_shaped_transports_load_with_either_worker_backend(transport):
    for backend in ("local", "ray"):
        cfg = load_config(None, [f"sync.transport={transport}", f"workers.backend={backend}"])
        assert (cfg.sync.transport, cfg.workers.backend) == (transport, backend)
        assert cfg.sync.packed is True  # vLLM's default, and the faster one on the CPU too


def test_the_old_broadcast_value_is_refused_saying_what_to_write():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["sync.transport=broadcast"])
    assert str(info.value).startswith(
        "config: sync.transport='broadcast' was renamed: write sync.transport=gloo"
    )


@pytest.mark.parametrize("transport", ["gloo", "nccl", "ipc"])
def test_a_server_transport_to_the_in_process_engine_is_refused_saying_why(transport):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"sync.transport={transport}", "engine.backend=inprocess"])
    assert "engine.backend='inprocess' has none" in str(info.value)
    assert load_config(None, ["engine.backend=inprocess"]).sync.transport == "disk"


def test_a_group_init_fault_needs_a_group_transport():
    with pytest.raises(ConfigError, match=r"set sync\.transport=gloo \(or nccl\) to reach it"):
        load_config(None, ["faults=init_process_group:hang"])
    cfg = load_config(None, ["faults=init_process_group:hang", "sync.transport=gloo"])
    assert cfg.faults == "init_process_group:hang"
