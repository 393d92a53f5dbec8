"""The reference server's weight-transfer backends: what it refuses, and why, on this machine.

A real server in this process (``serve_reference``), real HTTP. ``nccl`` and ``ipc`` need
CUDA: on a CPU machine their init is refused with a 400 that says so (on a GPU machine
these refusals are skipped; the GPU check runs the backends themselves).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from engines.local.weight_routes import WeightReceiver
from engines.weight_transfer import ipc_init_info, nccl_init_info
from tests.engines.helpers import serve_reference

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


async def _init(url: str, init_info: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{url}/init_weight_transfer_engine", json={"init_info": init_info})


async def test_the_old_gloo_body_is_refused_as_vllm_refuses_it(model_dir: Path):
    old = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    async with serve_reference(model_dir) as url:
        r = await _init(url, {**old, "backend": "gloo", "group_timeout_s": 5.0})
        assert r.status_code == 400
        assert "init_info names no backend in vLLM's protocol" in r.text
        r = await _init(url, {**old, "group_timeout_s": 5.0})
        assert r.status_code == 400
        assert "unknown field(s) ['group_timeout_s']" in r.text
        r = await _init(url, {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
        assert r.status_code == 400 and "missing field(s) ['rank_offset']" in r.text


@no_cuda
async def test_ipc_is_refused_without_cuda_saying_so(model_dir: Path):
    async with serve_reference(model_dir) as url:
        r = await _init(url, ipc_init_info(True))
        assert r.status_code == 400
        assert "ipc: the ipc weight-transfer backend needs CUDA" in r.text


@no_cuda
async def test_a_server_started_for_nccl_refuses_it_without_cuda(model_dir: Path):
    receiver = WeightReceiver(configured="nccl")
    body = nccl_init_info(master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2)
    async with serve_reference(model_dir, weight_receiver=receiver) as url:
        r = await _init(url, body)
        assert r.status_code == 400
        assert "backend nccl) needs CUDA" in r.text
    assert receiver.backend is None and receiver.group is None


async def test_updates_before_init_and_outside_an_update_are_conflicts(model_dir: Path):
    async with serve_reference(model_dir) as url, httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{url}/update_weights", json={"update_info": {"names": []}})
        assert r.status_code == 409 and "call /init_weight_transfer_engine first" in r.text
