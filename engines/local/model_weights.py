"""The reference engine's model weights: loaded (copied, or adopted as the parameters'
storage), zeroed (a level-2 sleep), and digested as vLLM's ``/weight_checker`` does."""

from __future__ import annotations

import hashlib

import torch

__all__ = ["WORKER_PREFIX", "load_into", "parameter_digests", "state_checksum", "zero_parameters"]

#: vLLM's ``/weight_checker`` key prefix of its one worker (data, pipeline, context, tensor rank).
WORKER_PREFIX = "dp0:pp0:pcp0:tp0:"


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor], adopt: bool = False) -> bool:
    """Copy ``state`` into ``model``'s parameters, or (``adopt``, where every tensor matches its
    parameter's dtype, shape and device and is contiguous) make them its storage; whether they
    were adopted. ``KeyError`` for an unknown name, before anything is loaded. Blocking."""
    with torch.no_grad():
        params = dict(model.named_parameters())
        unknown = [name for name in state if name not in params]
        if unknown:
            raise KeyError(f"unknown parameter {unknown[0]!r}")
        adopt = adopt and all(
            (t.dtype, t.shape, t.device) == (params[n].dtype, params[n].shape, params[n].device)
            and t.is_contiguous()
            for n, t in state.items()
        )
        for name, tensor in state.items():
            if adopt:
                params[name].data = tensor
            else:
                params[name].copy_(tensor)
        return adopt


def zero_parameters(model: torch.nn.Module) -> None:
    """Every parameter to zeros (a level-2 sleep discards the weights). Blocking."""
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()


def parameter_digests(model: torch.nn.Module) -> dict[str, str]:
    """vLLM's ``/weight_checker`` digests: sha256 of each parameter's own bytes (its dtype),
    keyed by the worker's ranks and the name (``dp0:pp0:pcp0:tp0:NAME``)."""
    return {
        f"{WORKER_PREFIX}{name}": hashlib.sha256(
            p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        ).hexdigest()
        for name, p in sorted(model.named_parameters())
    }


def state_checksum(named: dict[str, torch.Tensor]) -> str:
    """sha256 over each tensor's name and float32 bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(named):
        h.update(name.encode())
        h.update(named[name].detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()
