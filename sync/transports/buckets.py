"""Parameters grouped into buckets of at most ``bucket_bytes``, and vLLM's ``update_info``."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import torch

__all__ = ["Bucket", "plan_buckets", "update_bytes", "update_info"]

#: One bucket: (name, tensor) pairs in model order.
Bucket = list[tuple[str, torch.Tensor]]


def plan_buckets(params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters in buckets of at most ``bucket_bytes`` (one tensor may exceed it)."""
    buckets: list[Bucket] = []
    size = 0
    for name, param in params:
        nbytes = param.numel() * param.element_size()
        if not buckets or (buckets[-1] and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append((name, param))
        size += nbytes
    return buckets


def update_bytes(infos: Iterable[Mapping[str, Any]]) -> int:
    """The tensor bytes the ``update_info`` bodies ``infos`` announce (``sync/bytes``)."""
    total = 0
    for info in infos:
        for dtype, shape in zip(info["dtype_names"], info["shapes"], strict=True):
            size = torch.empty((), dtype=getattr(torch, dtype)).element_size()
            total += size * math.prod(shape)
    return total


def update_info(bucket: Bucket) -> dict[str, object]:
    """vLLM's ``update_info`` of a bucket: ``names``, ``dtype_names``, ``shapes``."""
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }
