"""FSDP2 data parallel (``workers.data_parallel=fsdp2``): shard the policy over the ranks.

:func:`shard_model` wraps each decoder layer, then the whole model, with PyTorch's
``fully_shard`` (as verl and SkyRL do): each rank keeps ``1/world`` of every parameter,
gradient and optimizer state, and gathers a layer's full weights only while it computes.
Gradients are reduce-*summed* (divide factor 1): each rank's loss is already its share of the
global token mean, so the sum is the single-worker gradient of the whole batch, as with the
replicated path's all-reduce (:mod:`trainer.workers.ray_actor`).

Every forward and backward is a collective: all ranks must run the same number of passes
(the Ray group pads each rank's shard to the same rows, see ``RayWorkerGroup``). Reading the
full weights is a collective too: :func:`gathered_model` runs on every rank, and rank 0 gets
a module whose ``named_parameters`` are the full tensors (what the weight transports read).

Never used at world size 1: there is nothing to shard, and it costs (measured 1.7x slower
per step on one H200 for a 494M model). So PyTorch's FSDP and DTensor modules are imported
only by a run that shards (they cost about 0.9 s at every trainer and worker start, measured
2026-12-08 at load 0.1): :func:`is_sharded` needs no import, because no parameter can be a
DTensor in a process that never imported ``torch.distributed.tensor``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import torch

__all__ = [
    "GatheredModel",
    "gathered_model",
    "is_dtensor",
    "is_sharded",
    "shard_model",
    "unsharded_in_turn",
]


def shard_model(model: torch.nn.Module) -> None:
    """``fully_shard`` each decoder layer (``model.model.layers``, if any; through a LoRA
    policy's peft wrapper), then ``model``. Frozen parameters (a LoRA policy's base) shard
    alike; only those with gradients are reduce-scattered.

    Needs the default process group (``torch.distributed.init_process_group``) formed; the
    parameters become DTensors, so an optimizer must be built *after* this.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    get_base_model = getattr(model, "get_base_model", None)  # a LoRA policy: peft's wrapper
    base = get_base_model() if callable(get_base_model) else model
    layers = getattr(getattr(base, "model", None), "layers", None)
    if isinstance(layers, torch.nn.ModuleList):
        for layer in layers:
            fully_shard(layer)
    fully_shard(model)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # a plain SUM (gloo has no PREMUL_SUM, and with factor 1 there is nothing to scale)
            module.set_force_sum_reduction_for_comms(True)


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    return any(is_dtensor(p) for p in model.parameters())


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (an FSDP2 shard). Never imports PyTorch's DTensor: a
    process that has not imported it has none."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


class GatheredModel(torch.nn.Module):
    """The full (unsharded) parameters of a sharded model, by their usual names; read-only."""

    def __init__(self, named: dict[str, torch.Tensor], config: object = None) -> None:
        super().__init__()
        self._full = {n: torch.nn.Parameter(t, requires_grad=False) for n, t in named.items()}
        self.config = config

    def named_parameters(  # type: ignore[override]
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, p in self._full.items():
            yield prefix + name, p

    def parameters(self, recurse: bool = True) -> Iterator[torch.nn.Parameter]:  # type: ignore[override]
        yield from self._full.values()


def gathered_model(
    model: torch.nn.Module, *, keep: bool, only: Callable[[str], bool] | None = None
) -> torch.nn.Module:
    """The full weights of ``model`` (a collective when sharded: call it on every rank), one
    parameter at a time; ``only`` those whose names it accepts, where given.

    ``keep`` is True on the rank that reads them (rank 0): it gets a :class:`GatheredModel`;
    the others drop each tensor as soon as it is gathered and get ``model`` back. An
    unsharded ``model`` is returned as it is.
    """
    if not is_sharded(model):
        return model
    from torch.distributed.tensor import DTensor

    named: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is not None and not only(name):
                continue
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if keep:
                named[name] = full
    return GatheredModel(named, getattr(model, "config", None)) if keep else model


def unsharded_in_turn(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Each FSDP2 module of ``model`` unsharded in turn (the root, then every decoder layer:
    the same order on every rank, as each unshard is an all-gather), yielded while its own
    parameters are full tensors and resharded before the next: at most one module's
    parameters are whole at a time, not the whole model's. What is
    read of a module must be copied before the next."""
    from torch.distributed.fsdp import FSDPModule

    for module in [m for m in model.modules() if isinstance(m, FSDPModule)]:
        module.unshard()
        try:
            yield module
        finally:
            module.reshard()
