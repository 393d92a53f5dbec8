"""The reference server's weight-transfer backends: what it refuses, and why, on this machine.

A real server in this process (``serve_reference``), real HTTP. ``nccl`` and ``ipc`` need
CUDA: on a CPU machine their init is refused with a 400, saying so (on a GPU machine these
refusals are skipped; the GPU check runs the backends themselves). A body of the wrong shape is a
400; a failed call answers as vLLM's does: 500, ``Call to collective_rpc method failed: Worker
failed with error '...'`` (real vLLM's own answers are compared in
tests/engines/vllm/test_differential.py).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import save_file

from engines.client import STEP_HEADER
from engines.local.weight_routes import (
    ALREADY_ACTIVE,
    NOT_STARTED,
    NOT_STARTED_FINISH,
    WeightReceiver,
)
from engines.weight_transfer import ipc_init_info, nccl_init_info
from tests.engines.helpers import serve_reference, serve_reference_engine
from trainer.vocabulary import install_faults

DISK = {"backend": "disk"}
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


async def _init(url: str, init_info: dict) -> httpx.Response:
    async with httpx.AsyncClient(timeout=60) as http:
        return await http.post(f"{url}/init_weight_transfer_engine", json={"init_info": init_info})


async def test_a_body_vllm_would_not_take_is_a_400_naming_the_field(model_dir: Path):
    """vLLM's worker fails on these (a 500 there); bad input is never a 5xx here."""
    old = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    async with serve_reference(model_dir) as url:
        r = await _init(url, {**old, "backend": "gloo", "group_timeout_s": 5.0})
        assert r.status_code == 400
        assert "init_info names no backend in vLLM's protocol" in r.text
        r = await _init(url, {**old, "group_timeout_s": 5.0})
        assert r.status_code == 400 and "unknown field(s) ['group_timeout_s']" in r.text
        r = await _init(url, {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2})
        assert r.status_code == 400 and "missing field(s) ['rank_offset']" in r.text
        r = await _init(url, [1])  # not the route's body: vLLM's request validation
        assert r.status_code == 400


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
        assert "the nccl weight-transfer backend needs CUDA" in r.text
    assert receiver.backend is None and receiver.group is None


async def test_calls_out_of_turn_are_refused_in_vllms_words(model_dir: Path, tmp_path: Path):
    receiver = WeightReceiver(weight_dir=str(tmp_path))
    async with (
        serve_reference(model_dir, weight_receiver=receiver) as url,
        httpx.AsyncClient(timeout=60) as http,
    ):

        async def post(path: str, body: dict) -> httpx.Response:
            return await http.post(f"{url}{path}", json=body)

        r = await post("/update_weights", {"update_info": {"names": []}})
        assert r.status_code == 500 and NOT_STARTED in r.text
        r = await post("/start_weight_update", {})
        assert r.status_code == 500 and "call /init_weight_transfer_engine" in r.text
        assert (await post("/init_weight_transfer_engine", {"init_info": DISK})).status_code == 200
        r = await post("/finish_weight_update", {})
        assert r.status_code == 500 and NOT_STARTED_FINISH in r.text
        assert (await post("/start_weight_update", {})).status_code == 200
        r = await post("/start_weight_update", {})
        assert r.status_code == 500 and ALREADY_ACTIVE in r.text
        assert (await post("/update_weights", {})).status_code == 400  # no update_info
        assert (await post("/finish_weight_update", {})).status_code == 200  # still open
        assert (await http.get(f"{url}/health")).status_code == 200


async def test_a_finish_names_the_weight_version_the_engine_serves(model_dir: Path, tmp_path: Path):
    """vLLM's ``weight_version`` label (a string) becomes the reference engine's version; a
    finish without one counts one more; a label that is not a whole number, or not a string
    (vLLM: 422), is refused before the update is touched, which stays open."""
    receiver = WeightReceiver(weight_dir=str(tmp_path))
    async with (
        serve_reference(model_dir, weight_receiver=receiver) as url,
        httpx.AsyncClient(timeout=60) as http,
    ):

        async def post(path: str, body: dict) -> httpx.Response:
            return await http.post(f"{url}{path}", json=body)

        async def version() -> int:
            return (await http.get(f"{url}/engine_stats")).json()["weight_version"]

        assert (await post("/init_weight_transfer_engine", {"init_info": DISK})).status_code == 200
        assert (await post("/start_weight_update", {})).status_code == 200
        assert (await post("/finish_weight_update", {"weight_version": "7"})).status_code == 200
        assert await version() == 7
        assert (await post("/start_weight_update", {})).status_code == 200
        assert (await post("/finish_weight_update", {})).status_code == 200
        assert await version() == 8
        assert (await post("/start_weight_update", {})).status_code == 200
        for label in (7, "v7", "-1", "3.0"):
            r = await post("/finish_weight_update", {"weight_version": label})
            assert r.status_code == 400 and "weight_version" in r.text, label
        assert await version() == 8
        assert (await post("/finish_weight_update", {"weight_version": "3"})).status_code == 200
        assert await version() == 3


async def test_drop_bucket_and_stale_acknowledge_what_they_leave_out(
    model_dir: Path, tmp_path: Path
):
    """The sampler-skewing faults answer 200 and leave the weights as they were:
    ``drop_bucket`` one bucket of an update (the step's), ``stale`` the whole update, whose
    version the engine names all the same."""
    install_faults("/update_weights:drop_bucket@2,/finish_weight_update:stale@3")
    receiver = WeightReceiver(weight_dir=str(tmp_path))
    async with (
        serve_reference_engine(model_dir, weight_receiver=receiver) as (url, engine),
        httpx.AsyncClient(timeout=60) as http,
    ):
        params = dict(engine.model.named_parameters())
        a, b = list(params)[:2]
        before = {n: params[n].detach().clone() for n in (a, b)}

        def bucket(name: str) -> dict:
            path = tmp_path / f"{name}.safetensors"
            save_file({name: torch.zeros_like(before[name])}, str(path))
            shape = list(before[name].shape)
            return {
                "names": [name],
                "dtype_names": ["float32"],
                "shapes": [shape],
                "path": str(path),
            }

        async def post(path: str, body: dict, step: int) -> None:
            r = await http.post(f"{url}{path}", json=body, headers={STEP_HEADER: str(step)})
            assert r.status_code == 200, r.text

        await post("/init_weight_transfer_engine", {"init_info": DISK}, 0)
        await post("/start_weight_update", {}, 2)
        await post("/update_weights", {"update_info": bucket(a)}, 1)  # applied
        await post("/update_weights", {"update_info": bucket(b)}, 2)  # dropped
        await post("/finish_weight_update", {"weight_version": "2"}, 2)
        assert not params[a].any()
        assert torch.equal(params[b], before[b])
        await post("/start_weight_update", {}, 3)
        await post("/update_weights", {"update_info": bucket(b)}, 3)
        await post("/finish_weight_update", {"weight_version": "3"}, 3)  # stale
        assert torch.equal(params[b], before[b])
        assert engine.weight_version == 3
