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


def test_broadcast_needs_rank_0_in_this_process():
    with pytest.raises(ConfigError, match=r"sync\.transport='broadcast'.*workers\.backend"):
        load_config(None, ["sync.transport=broadcast", "workers.backend=ray"])
    assert load_config(None, ["sync.transport=broadcast"]).sync.transport == "broadcast"
