"""The ``serve`` section: ``python -m trainer serve``, the training service that speaks the
Tinker protocol (docs/tinker.md)."""

from __future__ import annotations

from typing import Any

import attrs

from trainer.config._fields import config_field as _field
from trainer.config._fields import in_range, positive

__all__ = ["ServeConfig"]

#: The name the built-in tiny model is offered under (``model.path`` unset elsewhere).
TINY_MODEL_NAME = "tiny"


def _api_key(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v.startswith("tml-") and len(v) > 4):
        return None
    return "must start with 'tml-' (the Tinker SDK sends no other key)"


def _base_models(v: tuple[str, ...]) -> str | None:
    return None if v else "must name at least one model"


@attrs.define
class ServeConfig:
    host: str = _field(
        "127.0.0.1",
        "Address the service binds: loopback by default; another address lets every host that "
        "reaches it train with the key (docs/security.md).",
    )
    port: int = _field(
        8000,
        "Port the service binds; 0 picks a free one (the ready line says which).",
        check=in_range(0, 65535),
    )
    api_key: str | None = _field(
        None,
        "The key every client must send (the SDK sends its TINKER_API_KEY); required, 'tml-' "
        "and more. Give it by the environment variable: never written anywhere, never on a "
        "command line.",
        check=_api_key,
        env="TRAINER_SERVE_API_KEY",
    )
    base_models: tuple[str, ...] = _field(
        (TINY_MODEL_NAME, "smollm2-135m-instruct"),
        "The base models clients may train: 'tiny' (the built-in tiny model), a packaged "
        "model's short name, a Hugging Face directory or a .gguf file (model.path's values). "
        "Each is loaded when a client first creates a model on it.",
        check=_base_models,
    )
    request_timeout_s: float = _field(
        600.0,
        "Deadline of each operation (create_model, forward, forward_backward, optim_step): one "
        "past it fails, in the SDK's error shape, naming the operation.",
        check=positive,
    )
    checkpoint_dir: str = _field(
        "runs/serve/checkpoints",
        "Folder of the service's checkpoints: tinker://RUN/weights/NAME is RUN/weights/NAME "
        "under it (save_state, save_weights; load_state reads it back, in this service or a "
        "later one). A path that would leave it is refused.",
    )
    session_timeout_s: float = _field(
        180.0,
        "A session without a heartbeat for this long is ended and its models freed (the SDK "
        "sends one every 10 s and warns after 120 s without one).",
        check=positive,
    )
    future_ttl_s: float = _field(
        600.0,
        "An answered future can be retrieved for this long after its answer, then it is "
        "forgotten (the SDK polls at once; this covers a lost response).",
        check=positive,
    )
