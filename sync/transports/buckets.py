"""Parameters grouped into buckets of at most ``bucket_bytes``, and vLLM's ``update_info``."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["Bucket", "plan_buckets", "update_info"]

#: One bucket: (name, tensor) pairs in model order.
Bucket = list[tuple[str, torch.Tensor]]


def plan_buckets(
    params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, one_dtype: bool = False
) -> list[Bucket]:
    """Consecutive parameters in buckets of at most ``bucket_bytes`` (one tensor may exceed it).

    ``one_dtype``: a new bucket starts wherever the dtype changes (a bucket that travels as
    one flat buffer holds one dtype).
    """
    buckets: list[Bucket] = []
    size = 0
    for name, param in params:
        nbytes = param.numel() * param.element_size()
        new_dtype = one_dtype and buckets and buckets[-1][-1][1].dtype != param.dtype
        if not buckets or (buckets[-1] and size + nbytes > bucket_bytes) or new_dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, param))
        size += nbytes
    return buckets


def update_info(bucket: Bucket) -> dict[str, Any]:
    """vLLM's ``update_info`` of a bucket: ``names``, ``dtype_names``, ``shapes``."""
    return {
        "names": [name for name, _ in bucket],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
    }
