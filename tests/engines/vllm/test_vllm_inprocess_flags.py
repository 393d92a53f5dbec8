"""The in-process vLLM engine's flags: every field it sets is one of ``vllm serve``'s options, as
recorded from vLLM's own ``add_cli_args`` (``AsyncEngineArgs`` in ``reference/vllm_shapes.json``).
"""

from __future__ import annotations

import argparse
import json

import pytest

from engines.vllm.flags import (
    ENGINE_ARG_FLAGS,
    VllmSettings,
)
from tests.engines.vllm.stand_in import SHAPES

# -- the engine's flags: vllm serve's, as recorded from vLLM's add_cli_args ---------------------

ENGINE_ARGS = SHAPES["AsyncEngineArgs"]


def test_the_flags_the_engine_sets_are_vllms() -> None:
    recorded = {field: tuple(entry["flags"]) for field, entry in ENGINE_ARGS["cli"].items()}
    assert recorded == dict(ENGINE_ARG_FLAGS)
    assert set(ENGINE_ARGS["fields"]) == set(ENGINE_ARG_FLAGS)


def _parse_like_vllm(argv: list[str]) -> argparse.Namespace:
    """A parser with the recorded flags and defaults of the fields the engine sets (vLLM's own
    parser needs a device to build; it runs where vLLM does)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    for field, entry in ENGINE_ARGS["cli"].items():
        default = ENGINE_ARGS["fields"][field]["default"]
        kind = {"tensor_parallel_size": int, "seed": int, "gpu_memory_utilization": float}
        if field == "enable_sleep_mode":  # vLLM's bool fields: BooleanOptionalAction
            parser.add_argument(
                *entry["flags"], dest=field, default=default, action=argparse.BooleanOptionalAction
            )
        elif field == "weight_transfer_config":
            parser.add_argument(*entry["flags"], dest=field, default=default, type=json.loads)
        else:
            parser.add_argument(
                *entry["flags"], dest=field, default=default, type=kind.get(field, str)
            )
    namespace, rest = parser.parse_known_args(argv)
    namespace.rest = rest
    return namespace  # fmt: skip


def test_vllm_settings_argv_sets_each_field_by_its_vllm_flag() -> None:
    argv = VllmSettings(
        "/models/qwen",
        tensor_parallel_size=2,
        gpu_memory_utilization=0.5,
        seed=7,
        enable_sleep_mode=True,
        weight_transfer_backend="ipc",
        extra_args=("--max-model-len", "4096"),
    ).argv()
    parsed = _parse_like_vllm(argv)
    assert (parsed.model, parsed.tensor_parallel_size, parsed.gpu_memory_utilization) == (
        "/models/qwen",
        2,
        0.5,
    )
    assert (parsed.seed, parsed.enable_sleep_mode) == (7, True)
    assert parsed.weight_transfer_config == {"backend": "ipc"}
    assert parsed.rest == ["--max-model-len", "4096"]  # left to vLLM's parser


def test_vllm_settings_argv_defaults_are_vllms_where_it_sets_none() -> None:
    parsed = _parse_like_vllm(VllmSettings("m", weight_transfer_backend=None).argv())
    defaults = {f: e["default"] for f, e in ENGINE_ARGS["fields"].items()}
    assert parsed.gpu_memory_utilization == defaults["gpu_memory_utilization"]
    assert parsed.enable_sleep_mode is defaults["enable_sleep_mode"] is False
    assert parsed.weight_transfer_config is defaults["weight_transfer_config"] is None


@pytest.mark.parametrize(
    "extra", [["--seed", "3"], ["--tensor_parallel_size=2"], ["-tp", "2"], ["--no-enable-sleep-mode"], ["--weight-transfer-config.backend=ipc"]]
)  # fmt: skip
def test_extra_args_may_not_set_what_the_engine_sets(extra: list[str]) -> None:
    with pytest.raises(ValueError, match="the engine's own settings") as info:
        VllmSettings("m", extra_args=tuple(extra)).argv()
    field = next(f for f, flags in ENGINE_ARG_FLAGS.items() if f in str(info.value))
    assert field in ENGINE_ARG_FLAGS


def test_on_the_cpu_the_engine_serves_the_policys_dtype_eagerly_unless_told_otherwise() -> None:
    argv = VllmSettings("m", dtype="float32", cpu=True).argv()
    assert argv[argv.index("--dtype") + 1] == "float32" and "--enforce-eager" in argv
    theirs = VllmSettings(
        "m", dtype="float32", cpu=True, extra_args=("--dtype=bfloat16", "--no-enforce-eager")
    ).argv()
    assert "--dtype" not in theirs and "--enforce-eager" not in theirs  # the user's own flags win
    assert "--enforce-eager" not in VllmSettings("m", dtype="float32").argv()  # a GPU compiles
