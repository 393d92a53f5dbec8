"""The token-in route through the capture proxy (:mod:`trainer.generators.token_capture`):
``POST .../inference/v1/generate``, as verifiers' training client calls it.

The client (``renderers``' ``generate``, under verifiers 0.4's ``TrainClient``) renders the
chat itself and sends token ids; the engine (vLLM 0.32 ``--enable-scale-out``, or the
reference engine) answers token ids and, per token, ``{"token_id": N, "logprob": x, ...}``.
The proxy rewrites the request to the run's sampling, as it does for the OpenAI routes, and
adapts the answer to what the client parses:

- ``renderers`` 0.1.12 wants each logprob entry's ``token`` to be the string
  ``"token_id:N"`` (vLLM's placeholder form, which vLLM 0.32 writes only for
  ``output_mode="text"`` with ``--return-tokens-as-token-ids``; the client never asks for
  ``text``, and tokens mode has no ``token`` field): :func:`as_renderers_reads` adds it where
  it is missing, so the same client works against both engines. Nothing else is changed.
"""

from __future__ import annotations

from typing import Any

from engines.types import SamplingParams
from trainer.generators.turns import CapturedTurn

__all__ = ["TOKEN_IN_ROUTE", "as_renderers_reads", "rewrite_token_in", "token_in_turns"]

#: The route, under a trajectory's ``/t/<id>`` (vLLM mounts it at the server's root).
TOKEN_IN_ROUTE = "/inference/v1/generate"


def rewrite_token_in(
    request: dict[str, Any], sampling: SamplingParams, seed: int, model: str | None
) -> bool:
    """Set the run's sampling on a token-in ``request`` (in place); whether it asked for
    logprobs itself.

    ``temperature`` and ``top_p`` are the run's; ``max_tokens`` is capped at (and defaults
    to) ``sampling.max_tokens``; ``seed`` defaults to ``seed``; ``logprobs`` to 0 (the
    sampled token's own, which the trainer records); ``model`` is the engine's (dropped when
    the engine serves one model under no name the client knows).
    """
    sp = request.get("sampling_params")
    sp = dict(sp) if isinstance(sp, dict) else {}
    wanted = sp.get("logprobs") is not None
    sp["temperature"] = sampling.temperature
    sp["top_p"] = sampling.top_p
    asked = sp.get("max_tokens")
    sp["max_tokens"] = (
        sampling.max_tokens if asked is None else min(int(asked), sampling.max_tokens)
    )
    if sp.get("seed") is None:
        sp["seed"] = seed
    if not wanted:
        sp["logprobs"] = 0
    request["sampling_params"] = sp
    if model is not None:
        request["model"] = model
    else:
        request.pop("model", None)
    return wanted


def token_in_turns(request: dict[str, Any], answer: dict[str, Any]) -> list[CapturedTurn]:
    """What the engine returned for a token-in ``request``, one turn per choice."""
    prompt = [int(t) for t in answer.get("prompt_token_ids") or request["token_ids"]]
    turns = []
    for choice in answer.get("choices") or ():
        content = (choice.get("logprobs") or {}).get("content") or ()
        turns.append(
            CapturedTurn(
                list(prompt),
                [int(t) for t in choice["token_ids"]],
                [float(e["logprob"]) for e in content],
                choice.get("finish_reason") or "abort",
            )
        )
    return turns


def as_renderers_reads(answer: dict[str, Any], wanted_logprobs: bool) -> dict[str, Any]:
    """The engine's answer as the client parses it (see the module docstring): each logprob
    entry gets ``token`` ``"token_id:N"`` where it has none; logprobs the client did not ask
    for are taken out again."""
    for choice in answer.get("choices") or ():
        if not wanted_logprobs:
            choice["logprobs"] = None
            continue
        for entry in (choice.get("logprobs") or {}).get("content") or ():
            if "token" not in entry and "token_id" in entry:
                entry["token"] = f"token_id:{entry['token_id']}"
            for alternative in entry.get("top_logprobs") or ():
                if "token" not in alternative and "token_id" in alternative:
                    alternative["token"] = f"token_id:{alternative['token_id']}"
    return answer
