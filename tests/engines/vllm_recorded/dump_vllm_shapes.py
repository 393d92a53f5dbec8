"""Write ``vllm_shapes.json``: the shapes of vLLM's objects that ``engines.vllm``'s trainer-side modules use.

``tests/engines/test_vllm_inprocess*.py`` check the conversions against this file where vLLM
is not importable (CI, CPU machines), so regenerate it whenever the vLLM we target changes.

How it was run (vLLM 0.33.0 on a CPU machine, nothing installed into the project's venv;
only the modules below are imported, which works without a GPU)::

    pip install --no-deps --target /tmp/vllm_site vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    pip install --no-deps --target /tmp/vllm_site msgspec cbor2 psutil pyzmq openai-harmony \\
        openai prometheus_client pillow pybase64 cachetools cloudpickle uvloop py-cpuinfo \\
        xgrammar apache-tvm-ffi==0.1.11 fastapi starlette opentelemetry-api \\
        opentelemetry-sdk opentelemetry-semantic-conventions \\
        opentelemetry-semantic-conventions-ai partial-json-parser llguidance
    PYTHONPATH=/tmp/vllm_site .venv/bin/python tests/engines/vllm_recorded/dump_vllm_shapes.py

(torch, transformers, numpy and pydantic came from the project's venv.) With vLLM installed
normally, the last line alone does it. ``vllm_shapes()`` is also what the test compares this
file against on a machine where vLLM is importable.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("vllm_shapes.json")

#: ``AsyncLLM`` methods that ``engines.vllm.inprocess`` and ``engines.vllm.control`` call.
ASYNC_LLM_METHODS = (
    "from_engine_args",
    "generate",
    "check_health",
    "pause_generation",
    "resume_generation",
    "is_paused",
    "sleep",
    "wake_up",
    "is_sleeping",
    "reset_prefix_cache",
    "init_weight_transfer_engine",
    "start_weight_update",
    "update_weights",
    "finish_weight_update",
    "compute_weight_checksums",
    "add_lora",
    "shutdown",
)
#: ``AsyncEngineArgs`` fields that ``engines.vllm.flags.VllmSettings`` sets by their flags.
ENGINE_ARG_FIELDS = (
    "model",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "seed",
    "enable_sleep_mode",
    "weight_transfer_config",
    "enable_lora",
    "max_lora_rank",
    "max_loras",
)


def _jsonable(value: Any) -> Any:
    """``value`` if JSON keeps it as is, else its ``repr``."""
    try:
        if json.loads(json.dumps(value)) == value:
            return value
    except (TypeError, ValueError):
        pass
    return repr(value)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The string literal under each annotated class attribute (vLLM's field docs)."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def _parameters(fn: Any) -> dict[str, dict[str, Any]]:
    """Each parameter (but ``self``/``cls``) of ``fn``, in order: its kind and any default."""
    out: dict[str, dict[str, Any]] = {}
    for name, p in inspect.signature(fn).parameters.items():
        if name in ("self", "cls"):
            continue
        entry: dict[str, Any] = {"kind": p.kind.name}
        if p.default is not inspect.Parameter.empty:
            entry["default"] = _jsonable(p.default)
        out[name] = entry
    return out


def _cli_flags(add_cli_args: Any, fields: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """Each field's option strings in vLLM's ``add_cli_args`` source (``add_argument("--x",
    **group_kwargs["x"])``, ``dest=`` when given, else argparse's dest from the first long
    option), and the argparse action of a bool field.

    Read from the source, not from a built parser: building one needs vLLM's platform (a
    device), which a CPU machine without vLLM's CPU build does not have.
    """
    tree = ast.parse(inspect.cleandoc("\n" + inspect.getsource(add_cli_args)))
    out: dict[str, dict[str, Any]] = {}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
        field = None
        for kw in node.keywords:
            if kw.arg is None and isinstance(kw.value, ast.Subscript):
                key = kw.value.slice
                if isinstance(key, ast.Constant):
                    field = key.value
            elif kw.arg == "dest" and isinstance(kw.value, ast.Constant):
                field = kw.value.value
        long = [f for f in flags if isinstance(f, str) and f.startswith("--")]
        if field is None and long:  # argparse's own dest: ``--enable-lora`` -> enable_lora
            field = long[0][2:].replace("-", "_")
        if field in fields:
            out[field] = {"flags": flags}
    return out


def _dataclass_shape(cls: type) -> dict[str, Any]:
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    return {
        "qualname": f"{cls.__module__}.{cls.__qualname__}",
        "attributes": [f.name for f in fields],
        "required": [
            f.name
            for f in fields
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        ],
    }


def _struct_shape(cls: type) -> dict[str, Any]:
    """A ``msgspec.Struct``'s fields, as :func:`_dataclass_shape` gives a dataclass's."""
    import msgspec

    fields = msgspec.structs.fields(cls)
    return {
        "qualname": f"{cls.__module__}.{cls.__qualname__}",
        "attributes": [f.name for f in fields],
        "required": [f.name for f in fields if f.required],
    }


def vllm_shapes() -> dict[str, Any]:
    """The shapes of the installed vLLM, as written to ``vllm_shapes.json``."""
    import msgspec
    import vllm
    from vllm.config import ModelConfig, VllmConfig
    from vllm.distributed.weight_transfer.base import (
        WeightTransferInitRequest,
        WeightTransferUpdateRequest,
    )
    from vllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
    from vllm.logprobs import Logprob
    from vllm.lora.request import LoRARequest
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    docs = _attribute_docs(SamplingParams)
    sampling_fields: dict[str, Any] = {}
    for f in msgspec.structs.fields(SamplingParams):
        entry: dict[str, Any] = {}
        if f.default is not msgspec.NODEFAULT:
            entry["default"] = _jsonable(f.default)
        elif f.default_factory is not msgspec.NODEFAULT:
            entry["default_factory"] = repr(f.default_factory)
        if f.name in docs:
            entry["doc"] = docs[f.name]
        sampling_fields[f.name] = entry

    init = _parameters(RequestOutput.__init__)
    sample = RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=None,
        prompt_logprobs=None,
        outputs=[],
        finished=True,
    )
    return {
        "vllm_version": vllm.__version__,
        "SamplingParams": {
            "qualname": f"{SamplingParams.__module__}.{SamplingParams.__qualname__}",
            "fields": sampling_fields,
        },
        "RequestOutput": {
            "qualname": f"{RequestOutput.__module__}.{RequestOutput.__qualname__}",
            "attributes": sorted(vars(sample)),
            "required": [
                n for n, p in init.items() if "default" not in p and p["kind"] != "VAR_KEYWORD"
            ],
            "init_parameters": init,
        },
        "CompletionOutput": _dataclass_shape(CompletionOutput),
        "Logprob": _dataclass_shape(Logprob),
        "AsyncEngineArgs": {
            "qualname": f"{AsyncEngineArgs.__module__}.{AsyncEngineArgs.__qualname__}",
            "fields": {
                f.name: {"default": _jsonable(f.default), "type": str(f.type)}
                for f in dataclasses.fields(AsyncEngineArgs)
                if f.name in ENGINE_ARG_FIELDS
            },
            "cli": _cli_flags(AsyncEngineArgs.add_cli_args, ENGINE_ARG_FIELDS)
            | _cli_flags(EngineArgs.add_cli_args, ENGINE_ARG_FIELDS),
            "from_cli_args": _parameters(AsyncEngineArgs.from_cli_args),
            "add_cli_args": _parameters(AsyncEngineArgs.add_cli_args),
        },
        "VllmConfig": {"attributes": [f.name for f in dataclasses.fields(VllmConfig)]},
        "ModelConfig": {"attributes": [f.name for f in dataclasses.fields(ModelConfig)]},
        "WeightTransferInitRequest": _dataclass_shape(WeightTransferInitRequest),
        "WeightTransferUpdateRequest": _dataclass_shape(WeightTransferUpdateRequest),
        "LoRARequest": _struct_shape(LoRARequest),
        "AsyncLLM": {
            "qualname": f"{AsyncLLM.__module__}.{AsyncLLM.__qualname__}",
            "methods": {m: _parameters(getattr(AsyncLLM, m)) for m in ASYNC_LLM_METHODS},
        },
    }


def main() -> None:
    OUT.write_text(json.dumps(vllm_shapes(), indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
