"""What vLLM answers to a LoRA load or unload: its checks, their statuses and messages, and its
success sentences, in one place for the two engines that answer them as vLLM does (the
reference server's routes, ``engines/local/lora_routes.py``, and the in-process vLLM engine's,
``engines/vllm/lora.py``).

From ``OpenAIServingModels`` in vLLM 0.32.0 and 0.33.0 (``entrypoints/openai/models/serving.py``:
``_check_load_lora_adapter_request``, ``_check_unload_lora_adapter_request``), and what a probe
of vLLM's CPU build answered (docs/engines.md).
"""

from __future__ import annotations

__all__ = [
    "MAX_ADAPTER_CONFIG_BYTES",
    "LoraRefusal",
    "bad_adapter",
    "check_load",
    "check_unload",
    "in_place",
    "loaded",
    "removed",
    "string_field",
    "unknown_model",
]


#: The largest ``adapter_config.json`` a load reads (checked by its size before reading it):
#: peft writes a few hundred bytes.
MAX_ADAPTER_CONFIG_BYTES = 1024 * 1024


class LoraRefusal(Exception):
    """A load or unload vLLM refuses: its HTTP ``status``, error ``err_type`` and ``message``."""

    def __init__(self, status: int, err_type: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.err_type = err_type
        self.message = message
        #: The body field it is about, where vLLM's request model names one.
        self.param = param


def string_field(body: dict[str, object], name: str) -> str:
    """A string field of a load or unload body; ``LoraRefusal`` (400, ``Bad Request``) as
    vLLM's request model (pydantic) answers a missing one or one of another type."""
    value = body.get(name)
    if value is None:
        raise LoraRefusal(
            400,
            "Bad Request",
            f"1 validation error:\n  {{'type': 'missing', 'loc': 'body.{name}', 'msg': "
            f"'Field required', 'input': '<dict of {len(body)} items>'}}",
            f"body.{name}",
        )
    if not isinstance(value, str):
        raise LoraRefusal(
            400, "Bad Request", f"{name} must be a string, got {value!r}", f"body.{name}"
        )
    return value


def in_place(body: dict[str, object]) -> bool:
    """Whether a load body asks to replace a loaded adapter (``"load_inplace": true``)."""
    return body.get("load_inplace") is True


def check_load(name: str, path: str, *, base_model: str, loaded: bool, in_place: bool) -> None:
    """vLLM's checks of ``/v1/load_lora_adapter`` (under the name's lock, before the load):
    ``LoraRefusal`` for an empty name or path, the base model's name, or a name already loaded
    without ``load_inplace``."""
    if not name or not path:
        raise LoraRefusal(
            400, "InvalidUserInput", "Both 'lora_name' and 'lora_path' must be provided."
        )
    if name == base_model:
        raise LoraRefusal(
            400,
            "InvalidUserInput",
            f"The lora adapter '{name}' conflicts with a served base model.",
        )
    if loaded and not in_place:
        raise LoraRefusal(
            400,
            "InvalidUserInput",
            f"The lora adapter '{name}' has already been loaded. If you want to load the "
            "adapter in place, set 'load_inplace' to True.",
        )


def check_unload(name: str, *, loaded: bool) -> None:
    """vLLM's checks of ``/v1/unload_lora_adapter``: ``LoraRefusal`` for an empty or unknown
    name."""
    if not name:
        raise LoraRefusal(
            400, "InvalidUserInput", "'lora_name' needs to be provided to unload a LoRA adapter."
        )
    if not loaded:
        raise LoraRefusal(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")


def loaded(name: str) -> str:
    """The sentence vLLM answers a load with (a 200 whose body is text, not JSON)."""
    return f"Success: LoRA adapter '{name}' added successfully."


def removed(name: str) -> str:
    """The sentence vLLM answers an unload with."""
    return f"Success: LoRA adapter '{name}' removed successfully."


def bad_adapter(reason: str) -> LoraRefusal:
    """A directory whose adapter cannot be loaded (``reason``: vLLM's words where it has them,
    e.g. ``LoRA rank `r` must be a positive integer, got 0.``), in the frame vLLM answers a
    failed load with; a 400 where vLLM answers 500 (bad input is never a 5xx here)."""
    return LoraRefusal(
        400,
        "BadRequestError",
        f"Call to add_lora method failed: Worker failed with error '{reason}', please check "
        "the stack trace above for the root cause",
    )


def unknown_model(name: str) -> LoraRefusal:
    """A completion naming a model that is neither the base model nor a loaded adapter (vLLM's
    404, without the list of valid names its server adds)."""
    return LoraRefusal(404, "NotFoundError", f"The model `{name}` does not exist.")
