"""``engine.api_key`` is a secret: taken from ``TRAINER_ENGINE_API_KEY`` as given, written to no
config dump; and the one route vLLM unpickles is kept on this host unless the network is
trusted (``engine.trust_network``)."""

from __future__ import annotations

import pytest
import yaml

from trainer.config import load_config, to_dict
from trainer.config._load import help_text
from trainer.errors import ConfigError


@pytest.mark.parametrize("key", ["s3cr3t-Key_value", "123", "true", "a: b", "[x]"])
def test_the_key_comes_from_the_environment_as_given(monkeypatch, key):
    monkeypatch.setenv("TRAINER_ENGINE_API_KEY", key)
    assert load_config().engine.api_key == key  # text, never read as YAML


def test_the_environment_wins_over_the_command_line_and_neither_is_dumped(monkeypatch):
    monkeypatch.setenv("TRAINER_ENGINE_API_KEY", "from-env")
    cfg = load_config(None, ["engine.api_key=from-argv"])
    assert cfg.engine.api_key == "from-env"
    dumped = yaml.safe_dump(to_dict(cfg))
    assert "from-env" not in dumped and "from-argv" not in dumped
    assert to_dict(cfg)["engine"]["api_key"] is None  # type: ignore[index]


def test_a_key_from_yaml_is_not_dumped_either(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("engine:\n  api_key: in-a-file\n")
    cfg = load_config(path)
    assert cfg.engine.api_key == "in-a-file"
    assert "in-a-file" not in yaml.safe_dump(to_dict(cfg))


def test_help_names_the_variable():
    line = next(x for x in help_text().splitlines() if x.strip().startswith("engine.api_key "))
    assert "[env TRAINER_ENGINE_API_KEY]" in line


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.backend=vllm", "engine.placement=ray"],
        ["engine.backend=remote", "engine.urls=[http://10.0.0.5:8000]"],
        ["engine.backend=remote", "engine.urls=[http://127.0.0.1:8000,http://node-2:8000]"],
    ],
)
def test_ipc_beyond_this_host_is_refused_unless_the_network_is_trusted(overrides):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*overrides, "sync.transport=ipc"])
    message = str(info.value)
    assert "unpickle" in message and "engine.trust_network=true" in message
    assert "\n" not in message
    cfg = load_config(None, [*overrides, "sync.transport=ipc", "engine.trust_network=true"])
    assert cfg.engine.trust_network


@pytest.mark.parametrize(
    "overrides",
    [
        ["engine.backend=remote", "engine.urls=[http://127.0.0.1:8000,http://localhost:8001]"],
        ["engine.backend=vllm", "engine.placement=ray", "sync.transport=nccl"],
        ["engine.backend=vllm"],
    ],
)
def test_ipc_on_this_host_and_other_transports_need_no_trust(overrides):
    transport = [] if any(o.startswith("sync.") for o in overrides) else ["sync.transport=ipc"]
    assert not load_config(None, [*overrides, *transport]).engine.trust_network
