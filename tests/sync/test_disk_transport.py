"""The disk transport through a real reference server: the engine ends up with the policy's weights."""

from __future__ import annotations

import logging
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch
import trio

from engines.client import ControlRoutes, InferenceClient
from engines.launch import launch_local_engines
from engines.local.model_weights import state_checksum
from engines.models import build_tiny_model
from engines.types import SamplingParams
from sync.transports import DiskTransport, disk
from sync.weights import sync_weights
from trainer.errors import InferenceServerError
from trainer.workers.local import LocalWorkerGroup


async def test_disk_sync_makes_the_engine_serve_exactly_the_policy_weights(tmp_path):
    model_dir = build_tiny_model()
    workers = await LocalWorkerGroup.create(model_dir, policy_kwargs={"lr": 1e-3}, with_ref=False)
    with torch.no_grad():  # the policy moves away from the weights the server started with
        for p in workers.policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy_sum = state_checksum(dict(workers.policy.model.named_parameters()))
    async with launch_local_engines(
        1, model_dir, tmp_path / "logs", startup_timeout_s=180, weight_dir=tmp_path / "sync"
    ) as urls:
        async with InferenceClient(urls, api_key=urls.api_key) as client:
            (before,) = [
                r["checksum"]
                for r in await client.control(
                    "POST", "/weight_checker", json={"action": "checksum"}
                )
            ]
            assert before != policy_sum
            # a small bucket size: several /update_weights calls, applied together at finish
            transport = DiskTransport(tmp_path / "sync", bucket_bytes=64 * 1024)
            await transport.init(client, workers)
            assert not (tmp_path / "sync").exists()  # made by the first sync that writes
            result = await sync_weights(client, workers, transport, weight_version=7)
            (after,) = await client.control("POST", "/weight_checker", json={"action": "checksum"})
            assert isinstance(after, dict) and after["checksum"] == policy_sum
            assert after["weight_version"] == 7  # the trainer's version, not its own count (1)
            assert result["sync/last_weight_sync_seconds"] > 0
            assert not (await client.is_paused())[0]  # the bracket resumed generation
            completion = await client.generate([5, 6, 7], SamplingParams(max_tokens=2, seed=0))
            assert completion.finish_reason in ("stop", "length")
    assert not list((tmp_path / "sync").glob("v*"))  # bucket files are removed after the sync
    assert stat.S_IMODE((tmp_path / "sync").stat().st_mode) == 0o700  # the run's owner's alone
    await transport.close(workers)
    assert not (tmp_path / "sync").exists()  # a run leaves no empty weight folder


async def test_closing_the_disk_transport_keeps_a_weight_folder_that_holds_anything(tmp_path):
    """Only an empty folder is removed: a file someone put there (or a removal that was cut
    off at its bound) stays, and so does the folder."""
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "mine.txt").write_text("keep me")
    await DiskTransport(tmp_path / "sync", bucket_bytes=1024).close(None)  # type: ignore[arg-type]
    assert (tmp_path / "sync" / "mine.txt").read_text() == "keep me"
    await DiskTransport(tmp_path / "absent", bucket_bytes=1024).close(None)  # type: ignore[arg-type]


async def test_protocol_misuse_and_bad_buckets_are_refused_as_vllm_refuses_them(tmp_path):
    """The engine-side failures (a call out of order, a bucket file missing) are 500s in
    vLLM's frame (tests/engines/local/test_weight_transfer_routes.py); a body naming what the
    model lacks, or an init this machine cannot serve (``nccl`` without CUDA), a 400; a bucket
    outside the server's weight folder a 403. A failed update closes the update, as vLLM's
    does, so each bad bucket gets its own start."""
    model_dir = build_tiny_model()
    weight_dir = tmp_path / "sync"
    weight_dir.mkdir()
    nope = str(weight_dir / "nope")  # under the weight folder, no such file
    async with launch_local_engines(
        1, model_dir, tmp_path / "logs", startup_timeout_s=180, weight_dir=weight_dir
    ) as urls:
        async with InferenceClient(urls, api_key=urls.api_key) as client:

            async def status_of(path: str, body: dict) -> int:
                with pytest.raises(InferenceServerError) as info:
                    await client.control("POST", path, json=body)
                assert info.value.status is not None
                return info.value.status

            assert await status_of("/start_weight_update", {}) == 500  # before init
            nccl = {"init_info": {"backend": "nccl"}}
            if not torch.cuda.is_available():
                assert await status_of("/init_weight_transfer_engine", nccl) == 400
            await client.control(
                "POST", "/init_weight_transfer_engine", json={"init_info": {"backend": "disk"}}
            )
            assert (
                await status_of("/update_weights", {"update_info": {}}) == 500
            )  # outside an update
            assert await status_of("/finish_weight_update", {}) == 500
            unknown = {
                "names": ["no.such"],
                "dtype_names": ["float32"],
                "shapes": [[1]],
                "path": nope,
            }
            await client.control("POST", "/start_weight_update", json={})
            # a name the model lacks: the body is wrong, a 400 (vLLM's worker fails: a 500)
            assert await status_of("/update_weights", {"update_info": unknown}) == 400
            name = "model.norm.weight"
            missing_file = {
                "names": [name],
                "dtype_names": ["float32"],
                "shapes": [[64]],
                "path": nope,
            }
            await client.control("POST", "/start_weight_update", json={})
            assert await status_of("/update_weights", {"update_info": missing_file}) == 500
            wrong_shape = {
                "names": [name],
                "dtype_names": ["float32"],
                "shapes": [[3]],
                "path": nope,
            }
            await client.control("POST", "/start_weight_update", json={})
            assert await status_of("/update_weights", {"update_info": wrong_shape}) == 400
            assert await status_of("/finish_weight_update", {}) == 500  # the update was closed
            outside = {**missing_file, "path": str(tmp_path / "logs" / "engine-0.log")}
            await client.control("POST", "/start_weight_update", json={})
            assert await status_of("/update_weights", {"update_info": outside}) == 403
            await client.control("POST", "/start_weight_update", json={})
            await client.control(
                "POST", "/finish_weight_update", json={}
            )  # an empty update is fine


class _Rank0:
    """Rank 0 in a worker thread, over a small real model (the transport needs no more)."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(8, 8)

    async def run_on_rank0(self, fn, *args, abandon_on_cancel=False):
        return await trio.to_thread.run_sync(
            fn, self.model, *args, abandon_on_cancel=abandon_on_cancel
        )


class _Engine(ControlRoutes):
    """Accepts every call of the update protocol, as a server that is up would."""

    urls = ["http://engine"]

    def __init__(self) -> None:
        self.paths: list[str] = []

    async def control(self, method, path, params=None, json=None):
        self.paths.append(path)
        return [{}]

    async def control_one(self, url, method, path, params=None, json=None):
        (answer,) = await self.control(method, path, params, json)
        return answer

    async def _unused(self, *args, **kwargs):
        raise AssertionError("a transfer makes control calls only")

    generate = generate_n = max_model_len = _unused


async def test_a_removal_of_the_bucket_files_that_hangs_is_given_up_on_after_its_bound(
    tmp_path, monkeypatch, caplog
):
    """A slow disk (the removal's thread really blocks) holds the sync at most
    ``disk.REMOVE_BOUND_S``; the directory it could not remove is named in a warning and
    removed by the next transfer."""
    released, removed = threading.Event(), threading.Event()
    removing: list[Path] = []
    real_rmtree = shutil.rmtree

    def stuck_rmtree(path, ignore_errors=False):
        removing.append(Path(path))
        released.wait(20)  # a disk that does not answer for 20 s
        real_rmtree(path, ignore_errors)
        removed.set()

    monkeypatch.setattr(disk, "REMOVE_BOUND_S", 0.5, raising=False)
    monkeypatch.setattr(disk.shutil, "rmtree", stuck_rmtree)
    transport, engine = DiskTransport(tmp_path / "sync", bucket_bytes=1 << 20), _Engine()
    try:
        with caplog.at_level(logging.WARNING, logger="sync"):
            await transport.transfer(engine, _Rank0())
        # the sync came back while the removal's thread was still blocked
        assert not removed.is_set() and removing == [tmp_path / "sync" / "v1"]
        assert engine.paths[-1] == "/finish_weight_update"
        assert f"could not remove {tmp_path / 'sync' / 'v1'} within 0.5s" in caplog.text
    finally:
        released.set()
    monkeypatch.setattr(disk.shutil, "rmtree", real_rmtree)
    await transport.transfer(engine, _Rank0())
    assert not list((tmp_path / "sync").glob("v*"))  # the leftover v1 went with v2
