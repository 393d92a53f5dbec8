"""Write ``vllm_openai_schemas.json``: the JSON schemas of vLLM's OpenAI-server pydantic models.

``tests/engines/local/test_openai_routes.py`` validates the reference server's answers (chat and
completions, whole and streamed) against these schemas, so the server's shapes are vLLM's own.
Regenerate the file whenever the vLLM we follow changes.

How it was run (vLLM 0.33.0 on a CPU machine, nothing installed into the project's venv: the
same ``/tmp/vllm_site`` as ``dump_vllm_shapes.py``, which lists what was pip-installed there;
only the protocol modules are imported, which works without a GPU, in a few minutes)::

    PYTHONPATH=/tmp/vllm_site .venv/bin/python tests/engines/vllm_recorded/dump_vllm_openai_schemas.py

(pydantic came from the project's venv.) With vLLM installed normally, that line alone does it.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_openai_schemas.json")

#: The models dumped, by the module that defines them in vLLM 0.33.0.
MODELS = {
    "vllm.entrypoints.openai.chat_completion.protocol": (
        "ChatCompletionRequest",
        "ChatCompletionResponse",
        "ChatCompletionStreamResponse",
    ),
    "vllm.entrypoints.openai.completion.protocol": (
        "CompletionRequest",
        "CompletionResponse",
        "CompletionStreamResponse",
    ),
}


def vllm_openai_schemas() -> dict[str, Any]:
    """``{"vllm_version": ..., "schemas": {name: JSON schema}}`` of the installed vLLM.

    Response models are dumped in pydantic's serialization mode (what the server writes);
    request models in validation mode (what it accepts).
    """
    import vllm

    schemas: dict[str, Any] = {}
    for module_name, names in MODELS.items():
        module = importlib.import_module(module_name)
        for name in names:
            mode = "validation" if name.endswith("Request") else "serialization"
            schemas[name] = getattr(module, name).model_json_schema(mode=mode)
    return {"vllm_version": vllm.__version__, "schemas": schemas}


def main() -> None:
    OUT.write_text(json.dumps(vllm_openai_schemas(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
