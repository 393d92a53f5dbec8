"""The engine's settings as one value (:class:`VllmSettings`) and as ``vllm serve`` flags: one
builder for the servers the trainer starts (:mod:`engines.vllm.serve`) and the in-process
engine (:mod:`engines.vllm.inprocess`).

::

    VllmSettings("/models/qwen", tensor_parallel_size=2, weight_transfer_backend="nccl",
                 extra_args=("--max-model-len", "4096")).argv()
    # ['--model', '/models/qwen', '--tensor-parallel-size', '2', '--seed', '0',
    #  '--weight-transfer-config', '{"backend": "nccl"}', '--max-model-len', '4096']

A new engine setting is a field here with its flag in :meth:`VllmSettings.argv` (and in
:data:`ENGINE_ARG_FLAGS`), the config key it comes from, and the run plan's line that reads
it (docs/architecture.md's worked example).

``extra_args`` (``engine.extra_args``) come last, as given, and may not set a field the
trainer sets (:data:`ENGINE_ARG_FLAGS`, vLLM 0.33.0's ``AsyncEngineArgs.add_cli_args``):
:func:`flag_clashes` names those, and the config refuses them at load.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

__all__ = [
    "ENGINE_ARG_FLAGS",
    "MAX_LORA_RANKS",
    "RUNTIME_LORA_ENV",
    "VLLM_SERVE_MODULE",
    "VLLM_TRANSPORTS",
    "VllmSettings",
    "WeightTransferBackend",
    "flag_clashes",
    "max_lora_rank_for",
]

#: What ``vllm serve`` runs: vLLM's OpenAI API server (``python -m`` of it takes ``--model``).
VLLM_SERVE_MODULE = "vllm.entrypoints.openai.api_server"
WeightTransferBackend = Literal["nccl", "ipc", "gloo", "disk"]
#: The ``sync.transport`` values a vLLM engine takes: vLLM's ``nccl`` and ``ipc``, and the
#: project's plugin's ``gloo`` and ``disk`` (:mod:`engines.vllm`).
VLLM_TRANSPORTS: tuple[str, ...] = typing.get_args(WeightTransferBackend)

#: ``AsyncEngineArgs`` field -> its ``vllm serve`` flags (vLLM 0.33.0's ``add_cli_args``):
#: the fields :class:`VllmSettings` sets, which ``extra_args`` may therefore not set.
ENGINE_ARG_FLAGS: Mapping[str, tuple[str, ...]] = {
    "model": ("--model",),
    "tensor_parallel_size": ("--tensor-parallel-size", "-tp"),
    "gpu_memory_utilization": ("--gpu-memory-utilization", "--device-memory-utilization"),
    "seed": ("--seed",),
    "enable_sleep_mode": ("--enable-sleep-mode",),
    "weight_transfer_config": ("--weight-transfer-config",),
    "enable_lora": ("--enable-lora",),
    "max_lora_rank": ("--max-lora-rank",),
    "max_loras": ("--max-loras",),
}

#: vLLM's allowed ``--max-lora-rank`` values (``vllm.config.lora.MaxLoRARanks``, 0.32/0.33).
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: What vLLM serves its LoRA load and unload routes only with, set true.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def max_lora_rank_for(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds an adapter of ``rank``;
    ``ValueError`` above vLLM's largest."""
    fitting = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fitting:
        raise ValueError(
            f"LoRA rank {rank} is above vLLM's largest --max-lora-rank {MAX_LORA_RANKS[-1]}"
        )
    return fitting[0]


def _flag_of(token: str) -> str | None:
    """The option a command-line token names, as vLLM's parser reads it: ``--a_b=1`` and
    ``--a-b.key`` name ``--a-b``, ``--no-a-b`` names ``--a-b`` (a boolean's negation)."""
    if token.startswith("--"):
        name = token[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
        return "--" + name.removeprefix("no-")
    if token.startswith("-") and len(token) > 1 and not token[1].isdigit():
        return token.split("=", 1)[0]
    return None


def flag_clashes(extra_args: Sequence[str]) -> list[str]:
    """The fields of :data:`ENGINE_ARG_FLAGS` that ``extra_args`` set, sorted (none: [])."""
    owners = {flag: field for field, flags in ENGINE_ARG_FLAGS.items() for flag in flags}
    return sorted({owners[f] for t in extra_args if (f := _flag_of(t)) in owners})


@attrs.frozen
class VllmSettings:
    """A vLLM engine's settings: what the trainer sets of ``vllm serve``'s engine arguments.

    ``gpu_memory_utilization`` None keeps vLLM's default; ``weight_transfer_backend`` None
    leaves the weight-transfer routes off (as ``vllm serve`` without
    ``--weight-transfer-config``); ``gloo`` and ``disk`` are the project's plugin's
    (:mod:`engines.vllm`). ``dtype``: ``--dtype`` unless ``extra_args`` sets one (None:
    vLLM's ``auto``, which serves a float32 checkpoint in bfloat16 on the CPU). ``cpu``:
    vLLM's CPU build, started with ``--enforce-eager`` (torch.compile's warm-up: 64 s to start
    against 37 s, no faster after) unless ``extra_args`` says ``--no-enforce-eager``.
    """

    model: str
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float | None = None
    seed: int = 0
    enable_sleep_mode: bool = False
    weight_transfer_backend: WeightTransferBackend | None = "nccl"
    extra_args: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    dtype: str | None = None
    cpu: bool = False
    #: ``--enable-lora --max-lora-rank N --max-loras 1`` (one adapter, the policy's, as the
    #: trainer serves it with ``sync.lora=adapter``); None: no LoRA.
    max_lora_rank: int | None = None
    #: ``--logprobs-mode`` unless ``extra_args`` sets one (None: vLLM's ``raw_logprobs``).
    logprobs_mode: str | None = None

    def argv(self, seed_offset: int = 0) -> list[str]:
        """``vllm serve``'s engine flags, ``--model`` first, ``extra_args`` last (``--seed``
        is ``seed + seed_offset``: server ``I`` of several samples its own stream).

        Raises ``ValueError`` for an unknown backend, and for ``extra_args`` that set a field
        these settings set (:func:`flag_clashes`), naming it.
        """
        backend, extra = self.weight_transfer_backend, self.extra_args
        if backend is not None and backend not in VLLM_TRANSPORTS:
            raise ValueError(
                f"weight_transfer_backend={backend!r}: one of {VLLM_TRANSPORTS} or None"
            )
        if clashes := flag_clashes(extra):
            raise ValueError(
                f"extra_args {list(extra)} set {', '.join(clashes)}, which the engine's own "
                "settings set: use those instead"
            )
        argv = ["--model", self.model, "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.gpu_memory_utilization is not None:
            argv += ["--gpu-memory-utilization", repr(float(self.gpu_memory_utilization))]
        argv += ["--seed", str(self.seed + seed_offset)]
        if self.enable_sleep_mode:
            argv.append("--enable-sleep-mode")
        if backend is not None:
            argv += ["--weight-transfer-config", json.dumps({"backend": backend})]
        if self.dtype is not None and "--dtype" not in {_flag_of(t) for t in extra}:
            argv += ["--dtype", self.dtype]
        if self.logprobs_mode is not None and "--logprobs-mode" not in {_flag_of(t) for t in extra}:
            argv += ["--logprobs-mode", self.logprobs_mode]
        if self.cpu and "--no-enforce-eager" not in extra:
            argv.append("--enforce-eager")
        if self.max_lora_rank is not None:
            argv += [
                "--enable-lora",
                "--max-lora-rank",
                str(self.max_lora_rank),
                "--max-loras",
                "1",
            ]
        return [*argv, *extra]
