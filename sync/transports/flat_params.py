"""Rank 0's parameters as views of one contiguous buffer, so a packed chunk is a slice of it.

Packing a chunk (one ``torch.cat`` into a send buffer) copies the whole model every sync.
On the CPU that copy competes with gloo's socket copies for the same cores, and broadcasting
each parameter from its own storage instead pays gloo's per-collective cost about once per
tensor (measured in docs/performance.md). With the parameters re-homed once into one flat
``uint8`` buffer in model order, each packed chunk (consecutive parameters, as
:func:`~engines.weight_transfer.packed_chunks` cuts them) is a contiguous byte range of that
buffer and goes on the wire as it is: one collective per chunk, no copy. The bytes are exactly vLLM's packed layout (the tensors' bytes back to back,
no padding), so the engine side is unchanged.

Re-homing keeps every ``Parameter`` object (only ``param.data`` is set, to a view), so the
optimizer, hooks and tied weights do not notice. Anything that later gives a parameter new
storage (``load_state_dict(assign=True)``, a device move) breaks the layout:
:func:`current_layout` notices and the next sync re-homes again (one copy).

It applies to plain CPU tensors only: a sharded (``DTensor``) parameter has no local bytes to
send, and on a GPU the packing copy runs at device bandwidth while a whole-model flat buffer
would cost device memory that offloading expects to free.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

__all__ = ["FlatParams", "bucket_views", "current_layout", "flatten_parameters"]


@attrs.frozen(eq=False)
class FlatParams:
    """One model's parameters re-homed into ``buffer``, each at its byte range."""

    #: The model's bytes, in model order (``uint8``, one allocation).
    buffer: torch.Tensor
    #: Each parameter's byte range in ``buffer``, by name: ``(start, end)``.
    spans: dict[str, tuple[int, int]]


def _flattenable(params: Sequence[tuple[str, torch.nn.Parameter]]) -> bool:
    """Whether every parameter is a plain, contiguous CPU tensor of one dtype."""
    if not params:
        return False
    dtype = params[0][1].dtype
    return all(
        type(p.data) is torch.Tensor
        and p.device.type == "cpu"
        and p.dtype == dtype
        and p.is_contiguous()
        for _, p in params
    )


def flatten_parameters(params: Sequence[tuple[str, torch.nn.Parameter]]) -> FlatParams | None:
    """Re-home ``params`` (``named_parameters()`` order) into one buffer; blocking.

    Returns None, changing nothing, unless every parameter is a plain contiguous CPU tensor
    and all share one dtype (mixed dtypes would leave views at offsets their dtype cannot
    start at). Costs one copy of the model and, for a moment, the model's size twice.
    """
    if not _flattenable(params):
        return None
    spans: dict[str, tuple[int, int]] = {}
    total = 0
    for name, p in params:
        nbytes = p.numel() * p.element_size()
        spans[name] = (total, total + nbytes)
        total += nbytes
    buffer = torch.empty(total, dtype=torch.uint8)
    with torch.no_grad():
        for name, p in params:
            start, end = spans[name]
            view = buffer[start:end].view(p.dtype).view(p.shape)
            view.copy_(p.data)
            p.data = view
    return FlatParams(buffer, spans)


def current_layout(
    flat: FlatParams | None, params: Sequence[tuple[str, torch.nn.Parameter]]
) -> bool:
    """Whether every parameter still lives at its span of ``flat`` (and no other is new)."""
    if flat is None or len(params) != len(flat.spans):
        return False
    base = flat.buffer.data_ptr()
    for name, p in params:
        span = flat.spans.get(name)
        if (
            span is None
            or type(p.data) is not torch.Tensor
            or p.data_ptr() != base + span[0]
            or p.numel() * p.element_size() != span[1] - span[0]
            or not p.is_contiguous()
        ):
            return False
    return True


def bucket_views(flat: FlatParams, plan: Sequence[Sequence[str]]) -> list[torch.Tensor] | None:
    """Each bucket (or chunk) of ``plan`` (names, in order) as one ``uint8`` slice of
    ``flat.buffer``; None if a bucket's names are not back to back in the buffer."""
    views = []
    for names in plan:
        start, end = flat.spans[names[0]]
        for name in names[1:]:
            s, e = flat.spans[name]
            if s != end:
                return None
            end = e
        views.append(flat.buffer[start:end])
    return views
