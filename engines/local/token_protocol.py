"""The token-in route ``POST /inference/v1/generate``: its request and response shapes, as vLLM
0.32 answers them (``vllm serve --enable-scale-out``, ``output_mode`` ``tokens``).

Token ids in, token ids out, no chat template and no detokenizing: the client renders the
prompt (verifiers' training client does, with ``renderers``). A request::

    {"model": "...", "token_ids": [1, 2, 3],
     "sampling_params": {"temperature": 1.0, "max_tokens": 32, "stop_token_ids": [2],
                         "logprobs": 1, "skip_special_tokens": false, "seed": 7}}

and its answer (one choice per ``sampling_params.n``)::

    {"request_id": "generate-tokens-...", "model": "...", "output_mode": "tokens",
     "choices": [{"index": 0, "finish_reason": "length", "stop_reason": null,
                  "token_ids": [28, 0],
                  "logprobs": {"content": [{"token_id": 28, "logprob": -3.86, "rank": 7,
                                            "top_logprobs": [{"token_id": 28, ...}]}, ...]},
                  ...}],
     "usage": {...}, ...}

Each logprob entry names its token by ``token_id`` (an int): vLLM's tokens mode has no
``token`` string (its ``token_id:N`` placeholders are for ``output_mode`` ``text``), and the
reference sends none either. ``top_logprobs`` holds, as vLLM's does, the sampled token first
and then the best alternatives, ``max(logprobs, 1)`` entries in all. ``rank`` is the sampled
token's 1-based rank where the reference knows it (it is among the alternatives asked for) and
null otherwise; vLLM always knows it (no client of the trainer reads it). A choice's
``weight_versions`` is null (vLLM labels its weights ``default`` until an update names them).

``sampling_params.prompt_logprobs`` (k) answers the top-level ``prompt_logprobs`` as the
completions route does (:func:`~engines.local.protocol.prompt_logprobs_json`).

What the reference does not do: ``stream`` (refused with a 400), ``output_mode`` ``text``
(refused), multimodal fields, and the sampling fields of
:data:`~engines.local.protocol.UNSUPPORTED_DEFAULTS` set to anything but "off". Unknown
fields are ignored, as vLLM ignores them. ``max_tokens`` absent or past the context is what
fits (vLLM's ``get_max_tokens``); a prompt that fills the context is a 400.

Pure (no I/O): bad input raises :class:`~engines.local.validation.ProtocolError` (vLLM's
error body; vLLM's own 400 for a missing field has ``type`` ``Bad Request``, the reference's
``BadRequestError``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import attrs

from engines.local.protocol import (
    UNSUPPORTED_DEFAULTS,
    parse_prompt_logprobs,
    prompt_logprobs_json,
    usage,
)
from engines.local.validation import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    ProtocolError,
    bool_field,
    check_model,
    int_field,
    is_int,
    parse_options,
    refuse_unsupported,
)
from engines.types import Completion, SamplingParams, nth_sample_params

__all__ = ["GENERATE_PATH", "TokenRequest", "parse_token_request", "token_response"]

#: Where vLLM serves the route (at the server's root, not under ``/v1``).
GENERATE_PATH = "/inference/v1/generate"
#: Top-level fields the reference refuses unless "off".
_UNSUPPORTED_TOP: dict[str, tuple[object, ...]] = {
    "stream": (None, False),
    "output_mode": (None, "tokens"),
    "features": (None,),
    "content_parts": (None,),
}


@attrs.frozen
class TokenRequest:
    """A validated ``POST /inference/v1/generate`` body."""

    #: The served model name the response reports.
    model: str
    #: ``generate-tokens-`` and the request's ``request_id`` (or a fresh one).
    request_id: str
    prompt_ids: list[int]
    #: Sampling of every choice (``max_tokens`` already fitted to the context).
    params: SamplingParams
    n: int
    #: None: no logprobs; N: each token's logprob and ``max(N, 1)`` top entries.
    logprobs: int | None
    #: Whether the response carries ``prompt_token_ids``.
    return_token_ids: bool
    #: vLLM's ``sampling_params.prompt_logprobs`` (None: none; k: each prompt token's and
    #: the k best).
    prompt_logprobs: int | None = None

    def params_for(self, i: int) -> SamplingParams:
        """Sampling params of the ``i``-th choice (distinct seeds)."""
        return nth_sample_params(self.params, i)


def parse_token_request(
    body: dict[str, object], *, served_model: str, vocab_size: int, max_model_len: int
) -> TokenRequest:
    """Validate a token-in body; raises :class:`ProtocolError` (400, or 404 for another model)."""
    check_model(body, served_model)
    refuse_unsupported(body, _UNSUPPORTED_TOP)
    ids = body.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise ProtocolError(400, "token_ids must be a non-empty list of token ids", "token_ids")
    for tok in ids:
        if not is_int(tok) or not 0 <= tok < vocab_size:
            raise ProtocolError(
                400,
                f"token id {tok!r} in token_ids is out of vocabulary [0, {vocab_size})",
                "token_ids",
            )
    sp = body.get("sampling_params")
    if not isinstance(sp, dict):
        raise ProtocolError(400, "sampling_params must be an object", "sampling_params")
    refuse_unsupported(sp, UNSUPPORTED_DEFAULTS)
    room = max_model_len - len(ids)
    if room < 1:
        raise ProtocolError(
            400,
            f"The prompt ({len(ids)} tokens) does not fit the model's maximum context length "
            f"of {max_model_len} tokens.",
            "token_ids",
        )
    asked = int_field(sp, "max_tokens", room, 1)
    assert asked is not None
    logprobs = int_field(sp, "logprobs", None, 0, MAX_LOGPROBS)
    options = parse_options(
        {**sp, "stream": False, "stream_options": None},
        max_tokens=min(asked, room),
        top_logprobs=logprobs or 0,
    )
    prompt_k = parse_prompt_logprobs(sp)
    n = int_field(sp, "n", 1, 1, MAX_CHOICES)
    assert n is not None
    rid = body.get("request_id")
    if rid is not None and not isinstance(rid, str):
        raise ProtocolError(400, f"request_id must be a string, got {rid!r}", "request_id")
    return TokenRequest(
        model=served_model,
        request_id=f"generate-tokens-{rid or uuid.uuid4().hex[:16]}",
        prompt_ids=list(ids),
        params=attrs.evolve(options.params, prompt_logprobs=prompt_k),
        n=n,
        logprobs=logprobs,
        return_token_ids=bool_field(body, "return_token_ids", False),
        prompt_logprobs=prompt_k,
    )


def _logprob_entry(token: int, logprob: float, top: Sequence[tuple[int, float]], k: int):
    """One ``logprobs.content`` entry: the sampled token, then the best alternatives."""
    rank = next((i + 1 for i, (t, _) in enumerate(top) if t == token), None)
    entries = {token: logprob} | {t: lp for t, lp in top if t != token}
    ranks = {t: i + 1 for i, (t, _) in enumerate(top)}
    return {
        "token_id": token,
        "logprob": logprob,
        "rank": rank,
        "top_logprobs": [
            {"token_id": t, "logprob": lp, "rank": ranks.get(t)}
            for t, lp in list(entries.items())[: max(k, 1)]
        ],
    }


def token_response(
    req: TokenRequest, done: Sequence[Completion], *, decode_one: Callable[[int], str]
) -> dict[str, object]:
    """The route's answer for ``req``'s ``n`` completions, as vLLM's ``GenerateTokensResponse``
    (``decode_one``: one token id's text, a prompt logprob's ``decoded_token``)."""
    choices = []
    for i, c in enumerate(done):
        logprobs = None
        if req.logprobs is not None:
            tops = c.top_logprobs or [[] for _ in c.token_ids]
            logprobs = {
                "content": [
                    _logprob_entry(t, lp, top, req.logprobs)
                    for t, lp, top in zip(c.token_ids, c.logprobs, tops)
                ]
            }
        choices.append(
            {
                "index": i,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids),
                "routed_experts": None,
                "sampling_mask": None,
                "weight_versions": None,
                "logprobs": logprobs,
            }
        )
    generated = sum(len(c.token_ids) for c in done)
    return {
        "request_id": req.request_id,
        "model": req.model,
        "created": int(time.time()),
        "usage": {
            **usage(len(req.prompt_ids), generated),
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None
        if req.prompt_logprobs is None or not done
        else prompt_logprobs_json(done[0].prompt_logprobs, decode_one, req.prompt_ids),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": list(req.prompt_ids) if req.return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": choices,
    }
