"""Move a policy's training state (parameters, gradients, optimizer state) off its device and back.

An engine colocated on the policy's GPU needs that GPU's memory while it generates; the
policy frees it after training (``offload_to_cpu``) and takes it back before the next
forward (``backload_to_gpu``). :func:`offload_training_state` moves every tensor of the
model and its optimizer that lives on ``source`` to ``target`` (page-locked host memory when
``target`` is the CPU and CUDA is present, so the copies are asynchronous DMA) and returns an
:class:`Offloaded` record of exactly what it moved; :func:`restore_training_state` moves
those tensors, and only those, back. Tensors that were elsewhere to begin with (AdamW keeps
its ``step`` counters on the CPU) are left alone both ways.

Blocking: call it where the worker's other calls run (a worker thread or the actor), never
on the trio thread. A parameter stays the same ``Parameter`` object (its ``.data`` is
replaced), so the optimizer's references and any transport's view of the model stay valid.
A model sharded by FSDP2 (DTensor parameters) is moved with ``module.to``, FSDP2's own way.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from trainer.workers.fsdp import is_dtensor, is_sharded

__all__ = ["Offloaded", "offload_training_state", "restore_training_state", "tensor_bytes"]


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes ``t``'s elements take (``numel * element_size``); a DTensor's local shard."""
    if is_dtensor(t):  # this rank holds its shard only
        t = t.to_local()  # type: ignore[attr-defined]
    return t.numel() * t.element_size()


@attrs.define(eq=False)
class Offloaded:
    """What :func:`offload_training_state` moved, to move it back."""

    #: Where the tensors were (and return to).
    source: torch.device
    #: Where they are now.
    target: torch.device
    #: The model (FSDP2-sharded models move as a whole with ``module.to``).
    model: torch.nn.Module
    #: Parameters whose data (and gradient, if any) were moved.
    params: list[torch.nn.Parameter]
    #: Optimizer-state entries moved, as ``(state dict, key)``.
    optimizer_entries: list[tuple[dict[str, Any], str]]
    #: Bytes moved (parameters, gradients and optimizer state).
    nbytes: int


def _move(t: torch.Tensor, device: torch.device, pin_memory: bool) -> torch.Tensor:
    """A copy of ``t`` on ``device`` (always a new tensor, even on the same device)."""
    pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    out.copy_(t, non_blocking=pin or t.device.type == "cuda")
    return out


def _on(t: torch.Tensor, device: torch.device) -> bool:
    """Whether ``t`` lives on ``device``; ``cuda`` without an index means the current one."""
    if t.device.type != device.type:
        return False
    if device.type == "cuda" and device.index is None:
        return t.device.index == torch.cuda.current_device()
    return t.device.index == device.index


def _synchronize(*devices: torch.device) -> None:
    if any(d.type == "cuda" for d in devices):
        torch.cuda.synchronize()


def _move_params(
    model: torch.nn.Module, source: torch.device, target: torch.device, pin_memory: bool
) -> tuple[list[torch.nn.Parameter], int]:
    params = [p for p in model.parameters() if _on(p, source)]
    nbytes = sum(
        tensor_bytes(p) + (tensor_bytes(p.grad) if p.grad is not None else 0) for p in params
    )
    if is_sharded(model):
        model.to(target)  # FSDP2 re-points its shards itself; gradients move with them
        return params, nbytes
    with torch.no_grad():
        for p in params:
            grad, p.grad = p.grad, None  # a gradient must match its parameter's device
            p.data = _move(p.data, target, pin_memory)
            if grad is not None:
                p.grad = _move(grad, target, pin_memory)
    return params, nbytes


def offload_training_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    source: torch.device,
    target: torch.device,
    *,
    pin_memory: bool = True,
) -> Offloaded:
    """Move every tensor of ``model`` and ``optimizer`` on ``source`` to ``target``; blocking.

    Returns the record :func:`restore_training_state` takes. ``source == target`` copies
    (fresh storage, same values), which is how the CPU tests exercise the movement.
    """
    params, nbytes = _move_params(model, source, target, pin_memory)
    entries: list[tuple[dict[str, Any], str]] = []
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and _on(value, source):
                nbytes += tensor_bytes(value)
                state[key] = _move(value, target, pin_memory)
                entries.append((state, key))
    _synchronize(source, target)
    return Offloaded(source, target, model, params, entries, nbytes)


def restore_training_state(offloaded: Offloaded) -> int:
    """Move what ``offloaded`` names back to its source device; the bytes moved; blocking."""
    source, model = offloaded.source, offloaded.model
    if is_sharded(model):
        model.to(source)
    else:
        with torch.no_grad():
            for p in offloaded.params:
                grad, p.grad = p.grad, None
                p.data = _move(p.data, source, pin_memory=False)
                if grad is not None:
                    p.grad = _move(grad, source, pin_memory=False)
    for state, key in offloaded.optimizer_entries:
        state[key] = _move(state[key], source, pin_memory=False)
    _synchronize(source, offloaded.target)
    return offloaded.nbytes
