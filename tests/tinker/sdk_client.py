"""Driven by the tests in .venv-tinker's Python (the official SDK, unchanged): trains a LoRA
client on the service at argv[1] and prints one JSON object of what it saw.

``python sdk_client.py URL SCENARIO [ARGS]`` with TINKER_API_KEY set; SCENARIO is ``train``
(forward, forward_backward with cross_entropy, optim_step, forward again; importance_sampling's
forward; a refused loss), ``wrong_key``, ``losses`` (each policy loss, forward_backward_custom),
``ckpt_save`` / ``ckpt_resume PATH`` (checkpoints), ``hang`` (a hung forward_backward),
``sample`` (train, then sampling clients: sdk_sampling.py), ``sample_async`` (the same through
the async API) or ``mismatch`` (a save ``sync.verify`` refuses). Never imports the trainer
(torch alone is borrowed from its environment, where .venv-tinker has none).
"""

from __future__ import annotations

import json
import os
import sys

try:
    import torch
except ImportError:  # .venv-tinker has no torch: forward_backward_custom needs it (the SDK's
    # own requirement, checked when tinker is imported), so borrow the trainer environment's,
    # after the SDK's own packages
    sys.path.append(os.environ["SDK_CLIENT_TORCH_SITE"])
    import torch

import tinker  # after torch: the SDK looks for it once, when imported
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
        client.forward([is_datum], "stable_reinforce").result()
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


SAMPLING = [-1.0, -2.0, -0.5, -3.0, -1.5, -2.5, -0.25]
ADVANTAGES = [0.0, 0.0, 1.0, -0.5, 2.0, 1.0, -1.0]
MASK = [0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0]
#: Each policy loss and the loss_fn_config it is called with.
LOSS_CONFIGS: dict[str, dict[str, float]] = {
    "ppo": {},
    "cispo": {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
}


def losses(url: str) -> dict:
    """Each policy loss's forward (its value on the base model), a bad loss_fn_config, and
    forward_backward_custom against cross_entropy on two models of the same seed."""
    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    inputs = {"target_tokens": TOKENS[1:], "logprobs": SAMPLING, "advantages": ADVANTAGES}
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs=inputs | {"sequence_ratio_mask": MASK},
    )
    out: dict = {"sampling": SAMPLING, "advantages": ADVANTAGES, "mask": MASK, "losses": {}}
    for name, config in LOSS_CONFIGS.items():
        result = client.forward([datum], name, config or None).result()
        out["losses"][name] = {
            "loss": result.metrics["loss:sum"],
            "logprobs": _lists(result)[0],
            "config": config,
        }
    try:
        client.forward([datum], "dro").result()
        out["dro_without_beta"] = None
    except tinker.RequestFailedError as exc:
        out["dro_without_beta"] = {"message": exc.message, "category": str(exc.category)}
    # the same supervised step two ways: the built-in loss, and a custom one of the same value
    sft = _datum()
    weights = torch.tensor(WEIGHTS)
    builtin = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    custom = service.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    fb = builtin.forward_backward([sft], "cross_entropy")
    builtin.optim_step(types.AdamParams(learning_rate=0.05)).result()

    def weighted_nll(data: list, logprobs: list) -> tuple:
        loss = -(logprobs[0] * weights).sum()
        return loss, {"custom_nll": float(loss.detach())}

    cfb = custom.forward_backward_custom([sft], weighted_nll)
    custom.optim_step(types.AdamParams(learning_rate=0.05)).result()
    cres = cfb.result()
    out["custom"] = {
        "builtin_loss": fb.result().metrics["loss:sum"],
        "custom_loss": cres.metrics["loss:sum"],
        "custom_metric": cres.metrics["custom_nll"],
        "builtin_after": _lists(builtin.forward([sft], "cross_entropy").result()),
        "custom_after": _lists(custom.forward([sft], "cross_entropy").result()),
    }
    return out


def _steps(client, n: int) -> dict:
    """``n`` supervised steps (Adam's moments matter: lr 0.05), then the datum's logprobs."""
    losses = []
    for _ in range(n):
        fb = client.forward_backward([_datum()], "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=0.05)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return {"losses": losses, "after": _lists(client.forward([_datum()], "cross_entropy").result())}


def _refused(call) -> dict | None:
    try:
        call()
    except tinker.RequestFailedError as exc:
        return {"message": exc.message, "category": str(exc.category)}
    except tinker.APIStatusError as exc:
        return {"message": str(exc.body), "status": exc.status_code}
    return None


def ckpt_save(url: str) -> dict:
    """Two steps, save_state, two more (the uninterrupted client); then load_state_with_optimizer
    on the same client and the same two steps again; the checkpoint routes around them."""
    service = tinker.ServiceClient(base_url=url)
    rest = tinker.RestClient(base_url=url)
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    first = _steps(client, 2)
    path = client.save_state("mid", user_metadata={"note": "after 2 steps"}).result().path
    uninterrupted = _steps(client, 2)
    client.load_state_with_optimizer(path).result()
    reloaded = _steps(client, 2)
    scratch = client.save_state("scratch").result().path
    listed = rest.list_checkpoints(client.model_id).result()
    rest.delete_checkpoint_from_tinker_path(scratch).result()
    after_delete = rest.list_checkpoints(client.model_id).result()
    info = rest.get_weights_info_by_tinker_path(path).result()
    runs = rest.list_training_runs().result()
    run = rest.get_training_run(client.model_id).result()
    return {
        "model_id": client.model_id,
        "path": path,
        "first": first,
        "uninterrupted": uninterrupted,
        "reloaded": reloaded,
        "listed": [(c.checkpoint_id, c.tinker_path, c.user_metadata) for c in listed.checkpoints],
        "after_delete": [c.checkpoint_id for c in after_delete.checkpoints],
        "info": {"base_model": info.base_model, "lora_rank": info.lora_rank},
        "runs": [r.training_run_id for r in runs.training_runs],
        "run": {
            "base_model": run.base_model,
            "lora_rank": run.lora_rank,
            "last_checkpoint": run.last_checkpoint.tinker_path if run.last_checkpoint else None,
        },
        "save_again": _refused(lambda: client.save_state("mid").result()),
        "escape": _refused(lambda: client.load_state("tinker://../weights/mid").result()),
        "escape_deeper": _refused(lambda: client.load_state("tinker://../../weights/x").result()),
        "escape_dots": _refused(
            lambda: client.load_state(f"tinker://{client.model_id}/weights/..").result()
        ),
        "missing": _refused(
            lambda: client.load_state(f"tinker://{client.model_id}/weights/nope").result()
        ),
    }


def ckpt_resume(url: str, path: str) -> dict:
    """A new client from ``path`` with its optimizer, and the same two steps."""
    service = tinker.ServiceClient(base_url=url)
    client = service.create_training_client_from_state_with_optimizer(path).result()
    return {"model_id": client.model_id, "resumed": _steps(client, 2)}


def hang(url: str) -> dict:
    """A step, then a forward_backward the service's fault hangs (step 2): the failed-request
    answer and its seconds; then what the broken model and a second model answer."""
    import time

    service = tinker.ServiceClient(base_url=url)
    client = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    first = _steps(client, 1)
    start = time.monotonic()
    hung = _refused(lambda: client.forward_backward([_datum()], "cross_entropy").result())
    seconds = time.monotonic() - start
    after = _refused(lambda: client.optim_step(types.AdamParams(learning_rate=0.05)).result())
    other = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    return {
        "first": first,
        "hung": hung,
        "seconds": seconds,
        "after": after,
        "model_id": client.model_id,
        "other": _steps(other, 1),
    }


SCENARIOS = {
    "hang": hang,
    "train": train,
    "wrong_key": wrong_key,
    "losses": losses,
    "ckpt_save": ckpt_save,
    "ckpt_resume": ckpt_resume,
}

if __name__ == "__main__":
    from sdk_sampling import mismatch, sample, sample_async

    SCENARIOS |= {"sample": sample, "sample_async": sample_async, "mismatch": mismatch}
    url, scenario, *args = sys.argv[1:]
    print(json.dumps(SCENARIOS[scenario](url, *args)))
