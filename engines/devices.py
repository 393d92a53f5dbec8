"""Where a model's tensors live: a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``) and a
dtype name (``auto``, ``float32``, ``bfloat16``), resolved in the process that holds the model.

Used by the reference engine (``--device``, ``engine.device``) and by the trainer's workers
(``workers.device``, ``workers.dtype``). Resolution happens where the model is, never on a
driver: a Ray driver without a GPU may drive actors that have one. ``auto`` is CUDA when this
process sees a CUDA device, else the CPU; the dtype ``auto`` is bfloat16 on CUDA and float32
on the CPU (so a CPU run is unchanged by either).
"""

from __future__ import annotations

from typing import Literal

import torch

from trainer.errors import ConfigError

__all__ = [
    "DEVICES",
    "DTYPES",
    "DeviceName",
    "DtypeName",
    "cuda_unavailable_reason",
    "resolve_device",
    "resolve_dtype",
]

DeviceName = Literal["auto", "cpu", "cuda"]
DtypeName = Literal["auto", "float32", "bfloat16"]
#: The values ``workers.device`` / ``engine.device`` take (``--device`` also takes ``cuda:N``).
DEVICES: tuple[DeviceName, ...] = ("auto", "cpu", "cuda")
#: The values ``workers.dtype`` / ``--dtype`` take.
DTYPES: tuple[DtypeName, ...] = ("auto", "float32", "bfloat16")


def cuda_unavailable_reason() -> str | None:
    """Why this process cannot use CUDA (None when it can), in words a user can act on."""
    if torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return (
            f"this torch ({torch.__version__}) is a CPU-only build: install a CUDA build of "
            "torch (docs/gpus.md#install-on-a-gpu-machine)"
        )
    return (
        f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device in this "
        "process (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them; a Ray actor sees "
        "only the GPUs it asked for: workers.gpus_per_worker)"
    )


def _where(key: str, name: str) -> str:
    """``config: workers.device='cuda'`` for a config key, ``--device cuda`` for a flag."""
    return f"{key} {name}" if key.startswith("--") else f"config: {key}={name!r}"


def _instead(key: str, *names: str) -> str:
    """What to pass instead, as it is typed: ``pass --device auto or --device cpu`` for a
    flag, ``set workers.device=auto or workers.device=cpu`` for a config key."""
    if key.startswith("--"):
        return "pass " + " or ".join(f"{key} {n}" for n in names)
    return "set " + " or ".join(f"{key}={n}" for n in names)


def resolve_device(name: str, *, key: str = "workers.device") -> torch.device:
    """``auto`` -> CUDA if this process sees one, else CPU; ``cpu``; ``cuda`` or ``cuda:N``.

    A CUDA device always comes back with its index (``cuda`` is this process's current
    device), so it compares equal to the device its tensors report.

    Raises ``ConfigError`` naming ``key`` (a config key or a ``--flag``) for CUDA on a
    process without it (saying what to do), a device index it does not have, or an unknown
    name.
    """
    if name == "auto":
        return _indexed(torch.device("cuda")) if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or name.startswith("cuda:"):
        reason = cuda_unavailable_reason()
        if reason is not None:
            raise ConfigError(
                f"{_where(key, name)} but {reason}; or {_instead(key, 'auto', 'cpu')} (auto: "
                "CUDA when available)"
            )
        device = torch.device(name)
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(
                f"{_where(key, name)} but this process sees {torch.cuda.device_count()} "
                "CUDA device(s)"
            )
        return _indexed(device)
    raise ConfigError(
        f"{_where(key, name)} is not allowed: choose one of 'auto', 'cpu', 'cuda', 'cuda:N'"
    )


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:N`` (this process's current device): tensors report their device with
    an index, ``torch.device("cuda") != torch.device("cuda:0")``, and ``set_device`` needs one."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def resolve_dtype(name: str, device: torch.device, *, key: str = "workers.dtype") -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on the CPU; ``float32``; ``bfloat16``.

    Raises ``ConfigError`` naming ``key`` for an unknown name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name == "float32":
        return torch.float32
    if name == "bfloat16":
        return torch.bfloat16
    raise ConfigError(
        f"{_where(key, name)} is not allowed: choose one of 'auto', 'float32', 'bfloat16'"
    )
