"""``sync``'s public names, pinned (a change to them is a decision, not an accident)."""

from __future__ import annotations

import importlib
import pkgutil

import pytest

import sync

#: Every public module of ``sync`` and its ``__all__``; private (``_x``) modules are not listed.
PUBLIC = {
    "sync": [],
    "sync.bracket": ["Bracket", "Cleanups", "open_bracket"],
    "sync.group": ["init_group"],
    "sync.registry": ["TRANSPORTS", "TransportName", "TransportSpec", "make_transport"],
    "sync.transports": [
        "BroadcastTransport",
        "DiskTransport",
        "InProcessTransport",
        "IpcTransport",
        "LoraAdapterTransport",
        "Rank0",
        "WeightTransport",
    ],
    "sync.transports.base": [
        "Rank0",
        "TransportSettings",
        "WEIGHT_DIR_MODE",
        "WeightTransport",
        "finish_body",
        "make_sync_dir",
        "remove_if_empty",
        "routes_of",
    ],
    "sync.transports.broadcast": ["BroadcastTransport"],
    "sync.transports.broadcast_rank0": [
        "GROUP",
        "group_endpoint",
        "host_group",
        "hosted_groups",
        "is_loopback",
        "leave_group",
        "plan_sync",
        "route_address",
        "send_buckets",
    ],
    "sync.transports.buckets": ["Bucket", "plan_buckets", "update_bytes", "update_info"],
    "sync.transports.flat_params": [
        "FlatParams",
        "bucket_views",
        "current_layout",
        "flatten_parameters",
    ],
    "sync.transports.disk": ["DiskTransport", "REMOVE_BOUND_S", "write_buckets"],
    "sync.transports.inprocess": ["InProcessTransport", "copy_weights"],
    "sync.transports.lora_adapter": ["LoraAdapterTransport", "write_adapter"],
    "sync.transports.ipc": ["IpcTransport", "ipc_plan", "pack_ipc_bucket", "release_ipc_buffer"],
    "sync.transfer": [
        "TRANSFER_GRACE_S",
        "abandoned_detail",
        "routes_of",
        "run_transfer",
        "transfer_weights",
    ],
    "sync.verify": ["DEFAULT_TOLERANCE", "LOW_PRECISION_TOLERANCE", "PROBE_TOKENS", "verify_sync"],
    "sync.weights": [
        "TRANSFER_GRACE_S",
        "abandoned_detail",
        "run_transfer",
        "save_weights_for_sampler",
        "sync_weights",
    ],
}


def _public_modules() -> list[str]:
    found = pkgutil.walk_packages(sync.__path__, "sync.")
    names = [
        m.name
        for m in found
        if not any(p.startswith("_") and p != "__main__" for p in m.name.split("."))
    ]
    return sorted(["sync", *names])


def test_every_public_module_is_pinned():
    assert _public_modules() == sorted(PUBLIC)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_all_is_pinned_and_every_name_exists(name):
    module = importlib.import_module(name)
    assert sorted(module.__all__) == PUBLIC[name]
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, f"{name}.__all__ names what it does not define: {missing}"
