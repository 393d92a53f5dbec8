"""Each weight transport is declared once (sync.registry): the config's allowed values, the
engines' backend names and the trainer halves all come from that one table."""

from __future__ import annotations

import typing
from pathlib import Path

import pytest

from engines.local.weight_routes import BACKENDS as REFERENCE_BACKENDS
from engines.vllm.flags import VLLM_TRANSPORTS
from sync.registry import TRANSPORTS, make_transport
from sync.transports import BroadcastTransport, DiskTransport, IpcTransport
from sync.transports.base import TransportSettings
from trainer.config import load_config
from trainer.config._engine import SyncConfig
from trainer.errors import ConfigError


def test_the_config_engines_and_registry_name_the_same_transports():
    names = tuple(TRANSPORTS)
    assert typing.get_args(attrs_type(SyncConfig, "transport")) == names
    assert set(VLLM_TRANSPORTS) == set(names) == set(REFERENCE_BACKENDS)
    with pytest.raises(ConfigError, match="choose one of 'disk', 'gloo', 'nccl', 'ipc'"):
        load_config(None, ["sync.transport=shm"])


def attrs_type(cls: type, field: str) -> object:
    return typing.get_type_hints(cls)[field]


@pytest.mark.parametrize(
    ("name", "cls"),
    [("disk", DiskTransport), ("gloo", BroadcastTransport), ("nccl", BroadcastTransport),
     ("ipc", IpcTransport)],
)  # fmt: skip
def test_each_name_builds_its_trainer_half_from_the_runs_settings(name, cls, tmp_path: Path):
    settings = TransportSettings(
        name, 1 << 20, tmp_path, group_init_timeout_s=5.0, timeout_s=7.0, packed=False
    )
    transport = make_transport(settings)
    assert type(transport) is cls and transport.bucket_bytes == 1 << 20
    if cls is BroadcastTransport:
        assert (transport.backend, transport.packed) == (name, False)
    if cls is DiskTransport:
        assert transport.directory == tmp_path


def test_what_a_transport_needs_is_read_from_its_spec():
    assert [n for n, s in TRANSPORTS.items() if s.group] == ["gloo", "nccl"]
    assert [n for n, s in TRANSPORTS.items() if s.same_gpu] == ["ipc"]
    with pytest.raises(ConfigError, match="one GPU's buffer"):
        load_config(
            None, ["engine.backend=vllm", "sync.transport=ipc", "engine.tensor_parallel_size=2"]
        )
