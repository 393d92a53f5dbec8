"""Write ``vllm_serve_flags.json``: every option ``vllm serve`` accepts, from vLLM's own parser.

``tests/engines/vllm/test_vllm_serve.py`` checks that the command line the trainer builds for
``engine.backend=vllm`` (:mod:`engines.vllm.serve`) uses only these options, each with the
number of values it takes, so the check runs where vLLM is not installed. Regenerate the file
whenever the vLLM the docs pin changes.

How it was run (vLLM 0.33.0 on a CPU machine, nothing installed into the project's venv: the
same ``/tmp/vllm_site`` as ``dump_vllm_shapes.py``, which lists what was pip-installed there;
vLLM's CPU platform lets its parser build without a GPU, in about 15 s)::

    VLLM_TARGET_DEVICE=cpu PYTHONPATH=/tmp/vllm_site .venv/bin/python \\
        tests/engines/vllm_recorded/dump_vllm_serve_flags.py

With vLLM installed normally (on a GPU machine), the same line without the first two
variables does it.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_serve_flags.json")


def _arity(action: argparse.Action) -> str:
    """``"0"`` (a switch), ``"1"`` (one value), or argparse's nargs (``"?"``, ``"*"``, ``"+"``)."""
    return "1" if action.nargs is None else str(action.nargs)


#: The fields of ``GET /server_info?config_format=json``'s ``vllm_config`` that
#: ``engines.vllm.serve.check_server_config`` reads, as (config class path, field).
SERVER_INFO_FIELDS = {
    "weight_transfer_config": ("vllm.config.vllm:VllmConfig", "weight_transfer_config"),
    "weight_transfer_config.backend": (
        "vllm.config.weight_transfer:WeightTransferConfig",
        "backend",
    ),
    "model_config": ("vllm.config.vllm:VllmConfig", "model_config"),
    "model_config.enable_sleep_mode": ("vllm.config.model:ModelConfig", "enable_sleep_mode"),
}


def _has_field(where: str, field: str) -> bool:
    module_name, _, name = where.partition(":")
    cls = getattr(importlib.import_module(module_name), name)
    return field in {f.name for f in dataclasses.fields(cls)}


def vllm_serve_flags() -> dict[str, Any]:
    """``{"vllm_version", "flags": {option: {"arity", "choices"}}, "server_info_fields"}`` of
    the installed vLLM (``server_info_fields``: which of :data:`SERVER_INFO_FIELDS` exist)."""
    import vllm
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    flags: dict[str, Any] = {}
    for action in parser._actions:  # noqa: SLF001 - argparse has no public list of its options
        for option in action.option_strings:
            if not option.startswith("--"):
                continue
            choices = sorted(map(str, action.choices)) if action.choices else None
            flags[option] = {"arity": _arity(action), "choices": choices}
    fields = {path: _has_field(*where) for path, where in SERVER_INFO_FIELDS.items()}
    return {
        "vllm_version": vllm.__version__,
        "flags": dict(sorted(flags.items())),
        "server_info_fields": fields,
    }


if __name__ == "__main__":
    OUT.write_text(json.dumps(vllm_serve_flags(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")
