"""The weight-transfer bodies this project sends are vLLM's ``nccl`` and ``ipc`` ones.

Checked against ``reference/vllm_weight_transfer.json``, dumped from vLLM 0.33.0's source by
``reference/dump_vllm_weight_transfer.py``, so these run without vLLM. The ``nccl`` bodies are
recorded from a real sync (``sync.transport=gloo``, which sends them unchanged) to a real
reference server; the ``ipc`` bodies are built by the functions the ``ipc`` transport sends
(its sync itself needs a GPU).
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.client import InferenceClient
from engines.launch import launch_local_engines
from engines.models import build_tiny_model
from engines.weight_transfer import (
    IPC_INIT_FIELDS,
    IPC_UPDATE_FIELDS,
    NCCL_INIT_FIELDS,
    NCCL_UPDATE_FIELDS,
    ipc_init_info,
    ipc_update_info,
    load_ipc_handles,
    packed_chunks,
    pickle_ipc_handles,
)
from sync.transports.broadcast import BroadcastTransport
from sync.weights import sync_weights
from trainer.workers.local import LocalWorkerGroup

VLLM = json.loads(
    (Path(__file__).parent / "vllm_recorded" / "vllm_weight_transfer.json").read_text()
)
_TYPES = {"str": str, "int": int, "bool": bool, "None": type(None), "list": list, "dict": dict}


def _kinds(type_text: str) -> tuple[type, ...]:
    """``"list[int] | None"`` -> ``(list, NoneType)`` (the outer types of a dumped annotation)."""
    parts, depth, current = [], 0, ""
    for ch in type_text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "|" and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += ch
    parts.append(current)
    return tuple(_TYPES[p.strip().split("[")[0]] for p in parts)


def conformance_errors(body: dict[str, Any], message: str) -> list[str]:
    """What in ``body`` vLLM's dataclass for ``message`` (e.g. ``nccl.init_info``) refuses."""
    fields = VLLM["messages"][message]["fields"]
    errors = [f"{message}: vLLM has no field {k!r}" for k in body if k not in fields]
    errors += [
        f"{message}: required field {k!r} missing"
        for k, f in fields.items()
        if f["required"] and k not in body
    ]
    for key, value in body.items():
        if key in fields:
            kinds = _kinds(fields[key]["type"])
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                errors.append(f"{message}.{key}: {value!r:.40} is not {fields[key]['type']}")
    return errors


class RecordingClient:
    """The real client, recording each weight-transfer body it sends."""

    def __init__(self, client: InferenceClient) -> None:
        self.client = client
        self.urls = client.urls
        self.bodies: list[tuple[str, Any]] = []

    async def control(self, method, path, params=None, json=None):
        self.bodies.append((path, json))
        return await self.client.control(method, path, params, json)

    async def control_one(self, url, method, path, params=None, json=None):
        self.bodies.append((path, json))
        return await self.client.control_one(url, method, path, params, json)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def test_our_field_tables_are_vllms():
    """The parser of the reference server and the builders use vLLM's field names."""
    for ours, message in [
        (NCCL_INIT_FIELDS, "nccl.init_info"),
        (NCCL_UPDATE_FIELDS, "nccl.update_info"),
        (IPC_INIT_FIELDS, "ipc.init_info"),
        (IPC_UPDATE_FIELDS, "ipc.update_info"),
    ]:
        assert list(ours) == list(VLLM["messages"][message]["fields"]), message
    assert VLLM["vllm_version"] == "0.33.0"
    # vLLM picks the backend at server start; no init_info carries it
    assert all("backend" not in m["fields"] for m in VLLM["messages"].values())


@pytest.mark.parametrize("packed", [True, False])
async def test_a_gloo_sync_sends_exactly_vllms_nccl_bodies(tmp_path, packed):
    model_dir = build_tiny_model()
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    async with launch_local_engines(1, model_dir, tmp_path / "logs", startup_timeout_s=180) as urls:
        async with InferenceClient(urls, api_key=urls.api_key) as real:
            client = RecordingClient(real)
            transport = BroadcastTransport(64 * 1024, group_init_timeout_s=120, packed=packed)
            await transport.init(client, workers)
            await sync_weights(client, workers, transport)  # type: ignore[arg-type]
            await transport.close(workers)
    paths = [path for path, _ in client.bodies]
    assert paths[0] == "/init_weight_transfer_engine" and paths[-1] == "/finish_weight_update"
    (init,) = [b["init_info"] for p, b in client.bodies if p == "/init_weight_transfer_engine"]
    updates = [b["update_info"] for p, b in client.bodies if p == "/update_weights"]
    # packed: one call for the whole model, as vLLM's trainer sends it (the engine cuts its
    # chunks); unpacked: a small bucket size gives several calls
    assert len(updates) == 1 if packed else len(updates) > 1
    errors = conformance_errors(init, "nccl.init_info")
    for update in updates:
        errors += conformance_errors(update, "nccl.update_info")
    assert errors == []
    assert init["packed"] is packed and init["packed_buffer_size_bytes"] == 64 * 1024
    assert {"master_address", "master_port"} <= set(init)  # the TCP rendezvous, not a unique id
    sent = [n for u in updates for n in u["names"]]
    assert sent == [n for n, _ in workers.policy.model.named_parameters()]


def test_the_ipc_bodies_are_vllms_packed_ipc_bodies():
    bucket = [("a.weight", torch.zeros(2, 3)), ("b.bias", torch.zeros(4, dtype=torch.bfloat16))]
    handle = pickle_ipc_handles({"GPU-uuid": (1, "handle", 2)})
    update = ipc_update_info(bucket, [24, 8], handle)
    errors = conformance_errors(ipc_init_info(True), "ipc.init_info")
    errors += conformance_errors(update, "ipc.update_info")
    assert errors == []
    assert update["dtype_names"] == ["float32", "bfloat16"] and update["shapes"] == [[2, 3], [4]]


def test_a_planted_field_fails_the_conformance_check():
    """The check can fail: what the old gloo body carried is refused, as vLLM refuses it."""
    old = {"master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2}
    assert conformance_errors(
        {**old, "backend": "gloo", "group_timeout_s": 5.0}, "nccl.init_info"
    ) == [
        "nccl.init_info: vLLM has no field 'backend'",
        "nccl.init_info: vLLM has no field 'group_timeout_s'",
    ]
    assert conformance_errors({"packed": "yes"}, "ipc.init_info") == [
        "ipc.init_info.packed: 'yes' is not bool"
    ]


def test_packed_chunks_are_cut_where_vllms_consumer_cuts_them():
    # a chunk ends with the entry whose bytes take it past the buffer size
    assert packed_chunks([4, 4, 4, 4, 4], 8) == [range(0, 3), range(3, 5)]
    assert packed_chunks([20, 1, 1], 8) == [range(0, 1), range(1, 3)]
    assert packed_chunks([8, 8], 8) == [range(0, 2)]  # 16 > 8 only at the second
    assert packed_chunks([], 8) == []


def test_ipc_handles_are_unpickled_admitting_only_what_a_handle_holds():
    # reduce_tensor's args on CUDA: (type(tensor), size, stride, offset, type(storage), dtype,
    # device, handle, ...) where the storage is tensor._typed_storage(): a TypedStorage
    storage = type(torch.zeros(2, dtype=torch.float16)._typed_storage())  # noqa: SLF001 (what reduce_tensor reads)
    assert storage is torch.storage.TypedStorage
    args = (torch.Tensor, torch.Size([2]), (1,), 0, storage, torch.float16, 0, b"h")
    assert load_ipc_handles(pickle_ipc_handles({"GPU-x": args})) == {"GPU-x": args}
    untyped = (torch.Tensor, torch.Size([2]), (1,), 0, torch.UntypedStorage, torch.float16)
    assert load_ipc_handles(pickle_ipc_handles([untyped])) == [untyped]

    class Payload:
        def __reduce__(self):
            return (print, ("side effect",))

    with pytest.raises(ValueError, match=r"may not hold builtins\.print"):
        load_ipc_handles(pickle_ipc_handles(Payload()))
    with pytest.raises(ValueError, match="ipc_handles_pickled"):
        load_ipc_handles("not base64!")
    assert pickle.loads(pickle.dumps(args)) == args  # the handle itself round-trips
