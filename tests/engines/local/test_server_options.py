"""The reference server as ``serve``'s options make it: sleep mode on (vLLM's sleep and wake-up
state machine) or off (refused, saying how), and the weight-transfer routes switched off (the
probe names vLLM's flag). Each test serves a server of its own in-process (``serve_reference``).
"""

from __future__ import annotations

import httpx
import pytest

from engines.client import WEIGHT_TRANSFER_ROUTES, InferenceClient
from engines.types import SamplingParams
from tests.engines.helpers import client_routes, serve_reference
from trainer.errors import InferenceServerError


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """One torch thread, like a server process (see ``one_torch_thread``): the in-process
    servers decode in this process."""


async def test_sleep_and_wake_up_follow_vllms_state_machine(model_dir) -> None:
    params = SamplingParams(max_tokens=4)
    # a server of its own: sleeping at level 2 discards the weights it started with
    async with (
        serve_reference(model_dir, sleep_mode=True) as url,
        InferenceClient([url]) as client,
        httpx.AsyncClient() as http,
    ):
        before = await client.weight_checksums()
        await client.sleep(1)
        assert await client.is_sleeping() == [True]
        with pytest.raises(InferenceServerError) as info:
            await client.generate([1, 2], params)
        assert info.value.status == 409 and "wake_up" in info.value.detail
        with pytest.raises(InferenceServerError) as info:
            await client.weight_checksums()
        assert info.value.status == 409

        await client.wake_up(["weights"])
        state = (await http.get(f"{url}/is_sleeping")).json()
        assert state == {"is_sleeping": True, "sleep_state": {"weights": False, "kv_cache": True}}
        with pytest.raises(InferenceServerError):
            await client.generate([1, 2], params)

        await client.wake_up(["kv_cache"])
        assert await client.is_sleeping() == [False]
        assert (await client.generate([1, 2], params)).token_ids
        assert await client.weight_checksums() == before  # level 1 kept the weights

        await client.sleep(2)
        await client.wake_up()
        assert await client.is_sleeping() == [False]
        assert await client.weight_checksums() != before  # level 2 discarded them


async def test_probe_names_the_vllm_flag_when_the_weight_transfer_routes_are_off(
    model_dir,
) -> None:
    async with (
        serve_reference(model_dir, weight_transfer_routes=False) as url,
        InferenceClient([url]) as client,
    ):
        await client.probe([*client_routes()])  # everything else is served
        with pytest.raises(InferenceServerError) as info:
            await client.probe(WEIGHT_TRANSFER_ROUTES)
        with pytest.raises(InferenceServerError) as posted:  # not only the probe's GET
            await client.control("POST", "/init_weight_transfer_engine", json={})
        async with httpx.AsyncClient() as http:
            log = (await http.get(f"{url}/control_log")).json()
    assert log == {"calls": [], "total": 0}  # probes' GETs and unserved routes are not calls
    assert info.value.status == 404
    assert info.value.url == url
    assert "--weight-transfer-config" in str(info.value)
    assert all(route in str(info.value) for route in WEIGHT_TRANSFER_ROUTES)
    assert posted.value.status == 404


async def test_without_sleep_mode_sleep_and_wake_up_are_refused_saying_how(model_dir) -> None:
    """``serve`` without ``--enable-sleep-mode``: 400 naming the flag; the engine serves on."""
    async with serve_reference(model_dir) as url, httpx.AsyncClient(timeout=60) as http:
        for path in ("/sleep?level=1", "/wake_up"):
            r = await http.post(f"{url}{path}")
            assert r.status_code == 400 and "--enable-sleep-mode" in r.text
        assert (await http.get(f"{url}/is_sleeping")).json()["is_sleeping"] is False
        body = {"prompt": [5, 6, 7], "max_tokens": 2}
        assert (await http.post(f"{url}/v1/completions", json=body)).status_code == 200
