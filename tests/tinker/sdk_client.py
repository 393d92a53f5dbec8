"""Driven by the tests in .venv-tinker's Python (the official SDK, unchanged): trains a LoRA
client on the service at argv[1] and prints one JSON object of what it saw.

``python sdk_client.py URL SCENARIO`` with TINKER_API_KEY set; SCENARIO is ``train`` (forward,
forward_backward with cross_entropy, optim_step, forward again; importance_sampling's forward;
a refused loss), ``sample`` (train, then sampling clients: sdk_sampling.py), ``sample_async``
(the same through the async API), ``mismatch`` (a save ``sync.verify`` refuses) or
``wrong_key``. Never imports the trainer.
"""

from __future__ import annotations

import json
import sys

import tinker
from tinker import types

TOKENS = [3, 17, 5, 22, 9, 41, 12, 30]
#: Position i predicts TOKENS[i + 1]; the first two targets are the prompt (weight 0).
WEIGHTS = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": WEIGHTS},
    )


def _lists(out: types.ForwardBackwardOutput) -> list[list[float]]:
    return [o["logprobs"].tolist() for o in out.loss_fn_outputs]


def train(url: str) -> dict:
    service = tinker.ServiceClient(base_url=url)
    caps = tinker.RestClient(base_url=url).get_server_capabilities().result()
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    info = client.get_info()
    datum = _datum()
    before = client.forward([datum], "cross_entropy").result()
    losses = []
    for _ in range(3):
        fb = client.forward_backward([datum], "cross_entropy")
        opt = client.optim_step(types.AdamParams(learning_rate=0.05))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    after = client.forward([datum], "cross_entropy").result()
    sampling = [-1.0, -2.0, -0.5, -3.0, -1.5, -2.5, -0.25]
    advantages = [0.0, 0.0, 1.0, -0.5, 2.0, 1.0, -1.0]
    is_datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={
            "target_tokens": TOKENS[1:],
            "logprobs": sampling,
            "advantages": advantages,
        },
    )
    is_out = client.forward([is_datum], "importance_sampling").result()
    try:
        client.forward([is_datum], "cispo").result()
        refused = None
    except tinker.RequestFailedError as exc:
        refused = {
            "type": type(exc).__name__,
            "message": exc.message,
            "category": str(exc.category),
        }
    return {
        "models": [m.model_name for m in caps.supported_models],
        "model_id": client.model_id,
        "lora_rank": info.lora_rank,
        "before": {"loss": before.metrics["loss:sum"], "logprobs": _lists(before)},
        "train_losses": losses,
        "after": {"loss": after.metrics["loss:sum"], "logprobs": _lists(after)},
        "importance_sampling": {
            "loss": is_out.metrics["loss:sum"],
            "logprobs": _lists(is_out),
            "sampling": sampling,
            "advantages": advantages,
        },
        "refused": refused,
    }


def wrong_key(url: str) -> dict:
    try:
        tinker.ServiceClient(base_url=url).create_lora_training_client(
            base_model="tiny", rank=4
        ).result()
    except tinker.APIStatusError as exc:
        return {"status": exc.status_code, "body": exc.body}
    return {"status": None}


if __name__ == "__main__":
    from sdk_sampling import mismatch, sample, sample_async

    url, scenario = sys.argv[1], sys.argv[2]
    scenarios = {"train": train, "wrong_key": wrong_key, "sample": sample}
    scenarios |= {"sample_async": sample_async, "mismatch": mismatch}
    print(json.dumps(scenarios[scenario](url)))
