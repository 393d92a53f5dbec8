"""One script of LoRA route calls, run against real vLLM and against the reference server: what
each answers (status, error type and message, or the success sentence), and the logprobs of a
completion through a reloaded adapter beside peft's for the same tokens.

Used by ``tests/engines/local/test_lora_serving.py`` (the reference, against vLLM's answers as
recorded) and ``tests/engines/vllm/test_lora_differential.py`` (both, live).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import httpx
import torch

__all__ = ["PROMPT", "completion", "make_adapters", "peft_logprobs", "run_script"]

PROMPT = [1, 5, 9, 12, 4, 7]


def make_adapters(model_dir: Path, root: Path) -> dict[str, Path]:
    """peft adapters of ``model_dir`` with trained-looking (nonzero) B, in ``root``: ``a8`` and
    ``a8b`` of rank 8, ``a16`` of rank 16."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

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


def completion(model: str) -> dict[str, object]:
    """A greedy completion of :data:`PROMPT` by ``model``, with logprobs and token ids."""
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": 4,
        "temperature": 0.0,
        "logprobs": 0,
        "return_token_ids": True,
    }


def peft_logprobs(model_dir: Path, adapter: Path, tokens: list[int]) -> list[float]:
    """peft's logprob of each of ``tokens`` after :data:`PROMPT`, through ``adapter``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = PeftModel.from_pretrained(base, adapter)
    with torch.no_grad():
        logprobs = model(torch.tensor([PROMPT + tokens])).logits[0].log_softmax(-1)
    return [float(logprobs[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


def _answer(response: httpx.Response) -> tuple[Any, ...]:
    """``(status, error type, message)``, or ``(status, text)`` of a success sentence."""
    try:
        body = response.json()
    except ValueError:
        return response.status_code, response.text
    if isinstance(body, dict) and "error" in body:
        return response.status_code, body["error"]["type"], body["error"]["message"]
    return response.status_code, "json"


async def run_script(
    http: httpx.AsyncClient, base: str, adapters: dict[str, Path]
) -> tuple[dict[str, tuple[Any, ...]], dict[str, Any]]:
    """The calls, in order, against the server ``http`` points at (serving ``base``, started
    with ``--max-lora-rank 8``): each call's answer by name, and the completion through the
    reloaded adapter (its token ids and logprobs) with the model cards."""
    answers: dict[str, tuple[Any, ...]] = {}
    data: dict[str, Any] = {}

    async def load(name: str, lora_name: str | None, path: Path | None, **extra: object) -> None:
        body: dict[str, object] = {**extra}
        if lora_name is not None:
            body["lora_name"] = lora_name
        if path is not None:
            body["lora_path"] = str(path)
        answers[name] = _answer(await http.post("/v1/load_lora_adapter", json=body))

    await load("load", "a", adapters["a8"])
    await load("load again", "a", adapters["a8"])
    first = (await http.post("/v1/completions", json=completion("a"))).json()
    answers["completion through a"] = (first["model"],)
    data["first"] = first["choices"][0]["logprobs"]["token_logprobs"]
    await load("load in place", "a", adapters["a8b"], load_inplace=True)
    reloaded = (await http.post("/v1/completions", json=completion("a"))).json()["choices"][0]
    data["reloaded"] = (reloaded["token_ids"], reloaded["logprobs"]["token_logprobs"])
    models = (await http.get("/v1/models")).json()["data"]
    data["cards"] = [(c["id"], c["parent"], c["root"]) for c in models]
    answers["unknown model"] = _answer(await http.post("/v1/completions", json=completion("nope")))
    await load("rank above the maximum", "b", adapters["a16"])
    await load("no adapter there", "c", adapters["a8"].parent / "nothing")
    await load("no path", "c", None)
    await load("the base model's name", base, adapters["a8"])
    answers["unload unknown"] = _answer(
        await http.post("/v1/unload_lora_adapter", json={"lora_name": "zzz"})
    )
    answers["unload"] = _answer(await http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}))
    answers["completion after unload"] = _answer(
        await http.post("/v1/completions", json=completion("a"))
    )
    return answers, data
