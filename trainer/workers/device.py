"""The collective backend of the workers' process groups, chosen from where the tensors are.

Device and dtype names resolve with :mod:`engines.devices` (shared with the reference engine).
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["collective_backend"]


def collective_backend(device: torch.device) -> Literal["nccl", "gloo"]:
    """The torch.distributed backend for tensors on ``device``: NCCL for CUDA, gloo otherwise
    (never from what the machine's driver reports: CPU tensors on a GPU machine need gloo)."""
    return "nccl" if device.type == "cuda" else "gloo"
