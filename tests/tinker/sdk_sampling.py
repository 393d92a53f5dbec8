"""The sampling scenarios of sdk_client.py (in .venv-tinker's Python, the official SDK
unchanged): a LoRA client trained a few steps, then its sampling clients. Never imports the
trainer; prints nothing (sdk_client.py prints the JSON).

``sample`` (the sync API): ``save_weights_and_get_sampling_client`` and samples of it (three
at once, seeded; the same again; a stop token; prompt logprobs, ``compute_logprobs``), each
sampled sequence scored by the training client's ``forward``; a named
``save_weights_for_sampler`` sampled through ``create_sampling_client(model_path=...)``; the
base model's sampler (with top-k prompt logprobs); a request not served; eight more saves,
after which the first sampler's weights are unloaded.
``sample_async``: a sampler save and samples through ``await``, several at once.
``mismatch``: a sampler save after five steps, which the tier's engine serves wrong.
"""

from __future__ import annotations

import asyncio

import tinker
from tinker import types

PROMPT = [3, 17, 5, 22, 9]
TOKENS = [3, 17, 5, 22, 9, 41, 12, 30]
WEIGHTS = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
MAX_TOKENS = 6


def _supervised() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS},
    )


def _scored(tokens: list[int]) -> types.Datum:
    """A datum whose forward scores ``tokens`` after PROMPT."""
    full = PROMPT + tokens
    weights = [0.0] * (len(PROMPT) - 1) + [1.0] * len(tokens)
    return types.Datum(
        model_input=types.ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights},
    )


def _params(seed: int, temperature: float = 1.0, **kwargs: object) -> types.SamplingParams:
    return types.SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, **kwargs)


def _seqs(response: types.SampleResponse) -> list[dict]:
    return [
        {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
        for s in response.sequences
    ]


def _policy_logprobs(
    client: tinker.TrainingClient, seqs: list[dict], *, prompt_only: bool = False
) -> list[list[float]]:
    """The trained policy's logprob of each sampled token (``prompt_only``: of each prompt
    token but the first), by the training client's forward."""
    out = client.forward([_scored(s["tokens"]) for s in seqs], "cross_entropy").result()
    start = 0 if prompt_only else len(PROMPT) - 1
    return [o["logprobs"].tolist()[start:] for o in out.loss_fn_outputs]


def sample(url: str) -> dict:
    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
    for _ in range(3):
        client.forward_backward([_supervised()], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(PROMPT)
    three = _seqs(sampler.sample(prompt, 3, _params(seed=7)).result())
    again = _seqs(sampler.sample(prompt, 3, _params(seed=7)).result())
    first = three[0]["tokens"]
    stop_token = first[2]
    stopped = _seqs(sampler.sample(prompt, 1, _params(seed=7, stop=[stop_token])).result())
    named = client.save_weights_for_sampler("after-3-steps").result().path
    by_path = service.create_sampling_client(model_path=named).result()
    by_path_seqs = _seqs(by_path.sample(prompt, 1, _params(seed=7)).result())
    base = service.create_sampling_client(base_model="tiny").result()
    base_seqs = _seqs(base.sample(prompt, 1, _params(seed=7)).result())
    with_prompt = sampler.sample(
        prompt, 1, _params(seed=7, temperature=0.7), include_prompt_logprobs=True
    ).result()
    base_prompt = base.sample(
        prompt, 1, _params(seed=7), include_prompt_logprobs=True, topk_prompt_logprobs=2
    ).result()
    last_two = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=2).result()
    try:
        sampler.sample(prompt, 1, _params(seed=7), topk_sample_logprobs=2).result()
        refused = None
    except tinker.RequestFailedError as exc:
        refused = {"message": exc.message, "category": str(exc.category)}
    for _ in range(8):  # nine unnamed saves in all: the first one's weights are unloaded
        client.save_weights_and_get_sampling_client().result()
    try:
        sampler.sample(prompt, 1, _params(seed=7)).result()
        dropped = None
    except tinker.RequestFailedError as exc:
        dropped = exc.message
    return {
        "three": three,
        "three_policy": _policy_logprobs(client, three),
        "again": again,
        "stop_token": stop_token,
        "stopped": stopped,
        "named_path": named,
        "by_path": by_path_seqs,
        "by_path_later": _seqs(by_path.sample(prompt, 1, _params(seed=7)).result()),
        "base": base_seqs,
        "base_policy": _policy_logprobs(client, base_seqs),
        "prompt_logprobs": with_prompt.prompt_logprobs,
        "prompt_policy": _policy_logprobs(client, [{"tokens": []}], prompt_only=True)[0],
        "last_two": last_two,
        "base_prompt_logprobs": base_prompt.prompt_logprobs,
        "base_topk": base_prompt.topk_prompt_logprobs,
        "not_served": refused,
        "dropped": dropped,
    }


async def _sample_async(url: str) -> dict:
    service = tinker.ServiceClient(base_url=url)
    client = await service.create_lora_training_client(base_model="tiny", rank=4, seed=3)
    await client.forward_backward([_supervised()], "cross_entropy")
    await client.optim_step(types.AdamParams(learning_rate=0.05))
    sampler = await client.save_weights_and_get_sampling_client()
    prompt = types.ModelInput.from_ints(PROMPT)
    answers = await asyncio.gather(
        *(sampler.sample(prompt, 2, _params(seed=seed)) for seed in (10, 20, 30))
    )
    seqs = [s for answer in answers for s in _seqs(answer)]
    scored = await client.forward([_scored(s["tokens"]) for s in seqs], "cross_entropy")
    policy = [o["logprobs"].tolist()[len(PROMPT) - 1 :] for o in scored.loss_fn_outputs]
    return {"seqs": seqs, "policy": policy}


def sample_async(url: str) -> dict:
    return asyncio.run(_sample_async(url))


def mismatch(url: str) -> dict:
    """A sampler save after five optim_steps (the step the tier's engine skews)."""
    client = tinker.ServiceClient(base_url=url).create_lora_training_client(
        base_model="tiny", rank=4, seed=5
    )
    client = client.result()
    for _ in range(5):
        client.forward_backward([_supervised()], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=0.05)).result()
    try:
        client.save_weights_and_get_sampling_client().result()
        return {"failed": None}
    except tinker.RequestFailedError as exc:
        return {"failed": {"message": exc.message, "category": str(exc.category)}}
