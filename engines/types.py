"""Values exchanged with an inference engine, whatever engine it is."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol, TypeAlias, runtime_checkable

import attrs

__all__ = [
    "JSON",
    "Completion",
    "ControlPlaneClient",
    "EngineClient",
    "FinishReason",
    "JSONValue",
    "PauseMode",
    "PromptLogprob",
    "QueryParams",
    "QueryValue",
    "SamplingParams",
    "nth_sample_params",
]

FinishReason = Literal["stop", "length", "abort"]
#: What ``pause`` does with requests in flight: freeze them, end them, or let them finish.
PauseMode = Literal["keep", "abort", "wait"]
#: A JSON value, read-only (``json.loads`` gives lists and dicts; a ``dict[str, str]`` is one).
JSONValue: TypeAlias = (
    "bool | int | float | str | Sequence[JSONValue] | Mapping[str, JSONValue] | None"
)
#: A JSON object, read-only (a route's answer).
JSON: TypeAlias = Mapping[str, JSONValue]
#: One query parameter's value, as httpx sends it (a sequence: the parameter repeated).
QueryValue: TypeAlias = (
    "str | int | float | bool | Sequence[str | int | float | bool | None] | None"
)
#: The query parameters of a control request.
QueryParams: TypeAlias = Mapping[str, QueryValue]


@attrs.frozen
class SamplingParams:
    """How to sample one completion (the subset of vLLM's ``SamplingParams`` we use)."""

    #: Softmax temperature; 0 means greedy.
    temperature: float = 1.0
    #: Nucleus sampling: keep the smallest set of tokens whose probability sums to ``top_p``.
    top_p: float = 1.0
    #: Most tokens to generate.
    max_tokens: int = 16
    #: Per-request seed; the same seed, prompt and weights give the same tokens. None: random.
    seed: int | None = None
    #: Extra token ids that end the completion (included in the output, like EOS).
    stop_token_ids: tuple[int, ...] = ()
    #: Keep generating past EOS until ``max_tokens``.
    ignore_eos: bool = False
    #: Strings that end the completion once its text contains one (vLLM's ``stop``); the
    #: tokens up to the one that completed the string are kept, the text is cut before it.
    stop: tuple[str, ...] = ()
    #: Most likely alternatives to report per sampled token (0: only the sampled token's
    #: logprob, the cheap path every training request takes). The reference engine reports
    #: them in ``Completion.top_logprobs``; ``InferenceClient`` does not ask servers for them.
    top_logprobs: int = 0
    #: vLLM's ``prompt_logprobs``: None: none; k: each prompt token's logprob under the model
    #: (raw logits, whatever the temperature; the first token has none) and the k most likely
    #: tokens at its position, in ``Completion.prompt_logprobs``.
    prompt_logprobs: int | None = None


def nth_sample_params(sampling: SamplingParams, i: int) -> SamplingParams:
    """How sample ``i`` of a request with ``n`` samples is drawn: seed ``seed + i``.

    This is vLLM's parallel sampling (``n > 1``: child ``i`` gets ``seed + index``), so ``n``
    samples in one request equal ``n`` requests seeded ``seed, seed + 1, ...``; without a
    seed every sample is random.
    """
    if sampling.seed is None or i == 0:
        return sampling
    return attrs.evolve(sampling, seed=(sampling.seed + i) % 2**64)


@attrs.frozen
class PromptLogprob:
    """One prompt token's logprob under the model given the tokens before it (vLLM's prompt
    logprobs: of the raw logits, whatever the sampling temperature)."""

    #: The prompt token's logprob.
    logprob: float
    #: Its 1-based rank in the vocabulary (how many tokens have a logprob at least its own).
    rank: int
    #: The ``SamplingParams.prompt_logprobs`` most likely ``(token id, logprob)`` at its
    #: position, best first (rank ``i + 1`` at index ``i``).
    top: list[tuple[int, float]] = attrs.field(factory=list)


@attrs.frozen
class Completion:
    """One sampled completion."""

    #: Sampled token ids, including the stop token when ``finish_reason == "stop"``.
    token_ids: list[int]
    #: Log-probability of each sampled token under the model (raw logits, vLLM's default).
    logprobs: list[float]
    #: ``stop`` (EOS or a stop token), ``length`` (max_tokens) or ``abort`` (engine paused with abort).
    finish_reason: FinishReason
    #: The prompt the completion continues.
    prompt_token_ids: list[int] = attrs.field(factory=list)
    #: What ended a ``stop`` completion when it was not EOS: the stop token id or the stop
    #: string (vLLM's ``stop_reason``); None otherwise.
    stop_reason: int | str | None = None
    #: Per sampled token, the ``SamplingParams.top_logprobs`` most likely ``(token id,
    #: logprob)``, best first; empty when none were asked for.
    top_logprobs: list[list[tuple[int, float]]] = attrs.field(factory=list)
    #: Per sampled token, the trainer's weight version that produced it, where the trainer
    #: tracks it (``trainer.strategy=fully_async``); empty otherwise. Engines leave it empty.
    weight_versions: list[int] = attrs.field(factory=list)
    #: With ``SamplingParams.prompt_logprobs``: one entry per prompt token, None for the first
    #: (nothing precedes it); empty otherwise.
    prompt_logprobs: list[PromptLogprob | None] = attrs.field(factory=list)


class EngineClient(Protocol):
    """What drives the inference engines, whatever they are: the one interface of a run.

    ``engines.client.InferenceClient`` implements it over HTTP (reference servers, ``vllm
    serve``), ``engines.local.inprocess.InProcessClient`` in this process. Generators see
    ``generate`` (``Generator.engine``); the weight-sync bracket uses the control calls, each
    of which reaches every engine.
    """

    @property
    def urls(self) -> Sequence[str]:
        """One entry per engine (its base URL; ``inprocess://0`` for the in-process engine)."""
        ...

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, *, trajectory_id: str | None = None
    ) -> Completion:
        """One completion of ``prompt_ids`` (operation ``generate``)."""
        ...

    async def generate_n(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        n: int,
        *,
        trajectory_id: str | None = None,
    ) -> list[Completion]:
        """``n`` completions of one prompt as one request (vLLM's ``n``; operation ``generate``).

        Completion ``i`` is sampled as by :func:`nth_sample_params` (seed ``seed + i``), so the
        result equals ``n`` separate ``generate`` calls with those seeds; the engine shares the
        prompt's prefill and pays one request's overhead instead of ``n``.
        """
        ...

    async def pause(self, mode: PauseMode = "keep") -> None:
        """Pause generation on every engine (``keep``: freeze in-flight requests, ``abort``:
        end them, ``wait``: drain them) (operation ``/pause``)."""
        ...

    async def resume(self) -> None:
        """Resume generation on every engine (operation ``/resume``)."""
        ...

    async def sleep(self, level: int = 1, mode: PauseMode | None = None) -> None:
        """Put every engine to sleep (1: weights offloaded, 2: discarded); ``mode`` says what
        happens to in-flight requests, as for :meth:`pause` (None: the engine's default,
        vLLM's ``abort``) (operation ``/sleep``)."""
        ...

    async def wake_up(self, tags: Iterable[str] | None = None) -> None:
        """Wake ``tags`` (``weights`` and/or ``kv_cache``; None or empty: both) on every
        engine (operation ``/wake_up``)."""
        ...

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        """Drop cached prefixes computed with earlier weights (with ``reset_running_requests``,
        requests in flight are recomputed too, as vLLM's ``/reset_prefix_cache`` does)."""
        ...

    async def max_model_len(self) -> int | None:
        """The shortest context of the engines (prompt plus completion tokens a request may
        hold), as vLLM's ``/v1/models`` reports it; None when the engines do not say."""
        ...


@runtime_checkable
class ControlPlaneClient(EngineClient, Protocol):
    """An :class:`EngineClient` whose engines take vLLM's control routes by path: what the
    route-based weight transports (``nccl``, ``gloo``, ``ipc``, ``disk``) drive.

    ``engines.client.InferenceClient`` (over HTTP) and ``engines.vllm.inprocess``'s engine
    (``AsyncLLM`` in this process) implement it; the in-process reference engine does not
    (its weights are loaded directly: ``sync.transport=inprocess``).
    """

    async def control_one(
        self,
        url: str,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> JSONValue:
        """``method path`` on the engine at ``url`` (operation ``path``), ``json`` its body
        (anything ``json.dumps`` takes); the route's answer, its JSON body decoded (None when
        empty).

        ``InferenceServerTimeoutError`` past the control-plane timeout;
        ``InferenceServerError`` (URL, endpoint, status) for a refused call or a malformed body.
        """
        ...

    async def control(
        self,
        method: str,
        path: str,
        params: QueryParams | None = None,
        json: object = None,
    ) -> list[JSONValue]:
        """:meth:`control_one` on every engine concurrently; their answers, in URL order (the
        first failure raised once every call ended, the others as its notes)."""
        ...

    async def get_world_size(self) -> list[int]:
        """Each engine's number of weight-receiving ranks (vLLM's tensor-parallel ranks)."""
        ...
