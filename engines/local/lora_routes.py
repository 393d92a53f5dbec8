"""The reference server's LoRA routes, ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``,
as vLLM answers them (``vllm/entrypoints/openai/models/serving.py`` in 0.32.0, and what a
probe of its CPU build answered: see docs/engines.md).

They exist where vLLM's do: the server started with ``--enable-lora`` and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` true in its environment; elsewhere they are 404. A load
names the adapter (``lora_name``) and its peft directory (``lora_path``); loading a name again
needs ``load_inplace: true`` (the trainer's every sync after the first), and keeps the name's
id. Success is a 200 whose body is a sentence, not JSON, as vLLM's.
"""

from __future__ import annotations

import logging
import os

from engines import lora_answers
from engines.local.engine import LocalEngine
from engines.local.http import Request, Response, json_response
from engines.local.protocol import parse_json_object
from engines.lora_answers import LoraRefusal, check_load, check_unload
from trainer.vocabulary import FaultAction, fire_fault, sampler_skew

__all__ = ["RUNTIME_LORA_ENV", "LoraRoutes", "runtime_lora_updating"]

log = logging.getLogger(__name__)

#: vLLM serves the routes only with this set true (``envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING``).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating() -> bool:
    """Whether this process's environment allows the routes, as vLLM reads it."""
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


def _error(status: int, err_type: str, message: str, param: str | None = None) -> Response:
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return json_response(body, status)


def _text(sentence: str) -> Response:
    return Response(200, sentence.encode(), content_type="text/plain; charset=utf-8")


class LoraRoutes:
    """The LoRA routes, over the engine :class:`~engines.local.server.ServerApp` holds."""

    engine: LocalEngine
    served_model: str

    async def load_lora_adapter(self, request: Request) -> Response:
        """Load an adapter, as vLLM does. ``TRAINER_FAULTS`` fire here, ``skip_load`` among
        them: the load is checked and answered as done, and not done (the adapter of the
        name, if any, serves on)."""
        await fire_fault(request.path, request.step)
        body = parse_json_object(request.body)
        try:
            name = lora_answers.string_field(body, "lora_name")
            path = lora_answers.string_field(body, "lora_path")
        except LoraRefusal as invalid:
            return _error(invalid.status, invalid.err_type, invalid.message, invalid.param)
        async with self.engine.adapter_lock:  # the checks and the load as one, as vLLM's
            try:
                check_load(
                    name,
                    path,
                    base_model=self.served_model,
                    loaded=name in self.engine.adapters,
                    in_place=lora_answers.in_place(body),
                )
                if sampler_skew(request.path, request.step) is FaultAction.SKIP_LOAD:
                    log.warning("fault skip_load: %s from %s acknowledged, not loaded", name, path)
                else:
                    await self.engine.load_adapter(name, path)
            except LoraRefusal as exc:
                return _error(exc.status, exc.err_type, exc.message)
        return _text(lora_answers.loaded(name))

    async def unload_lora_adapter(self, request: Request) -> Response:
        body = parse_json_object(request.body)
        try:
            name = lora_answers.string_field(body, "lora_name")
        except LoraRefusal as invalid:
            return _error(invalid.status, invalid.err_type, invalid.message, invalid.param)
        async with self.engine.adapter_lock:
            try:
                check_unload(name, loaded=name in self.engine.adapters)
            except LoraRefusal as exc:
                return _error(exc.status, exc.err_type, exc.message)
            del self.engine.adapters[name]
        return _text(lora_answers.removed(name))

    def adapter_cards(self) -> list[dict[str, object]]:
        """``/v1/models``' card of each loaded adapter, as vLLM lists them."""
        return [
            {
                "id": adapter.name,
                "object": "model",
                "created": 0,
                "owned_by": "vllm",
                "root": adapter.path,
                "parent": self.served_model,
                "max_model_len": None,
            }
            for adapter in self.engine.adapters.values()
        ]
