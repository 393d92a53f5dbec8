"""The weight transports by name: each declared once, with what it needs and its trainer half.

``sync.transport`` takes its allowed values from :data:`TRANSPORTS`; the config's checks, the
engines' start-up and the run's transport read a transport's needs from its
:class:`TransportSpec` instead of listing names. Torch-free: the config reads it at load; a
transport's class is imported only when :func:`make_transport` builds it.

Adding a transport touches its own module (``sync/transports/NAME.py``, a class with
``from_settings``), this registry, and its docs (the key's doc and docs/architecture.md's
worked example); the engines' halves (the reference engine's ``engines/local/weight_routes.py``,
vLLM's own backends or the project's vLLM plugin) are the engine side of the same name.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Literal

import attrs

if TYPE_CHECKING:
    from sync.transports.base import TransportSettings, WeightTransport

__all__ = ["TRANSPORTS", "TransportName", "TransportSpec", "make_transport"]


@attrs.frozen
class TransportSpec:
    """One weight transport: its name (as vLLM's ``--weight-transfer-config`` backend), where
    its trainer half lives, and what it needs."""

    name: TransportName
    #: ``module:Class`` of the trainer half (a :class:`~sync.transports.base.WeightTransport`).
    trainer_half: str
    #: It joins the engines in a process group (``init_process_group``: gloo, nccl).
    group: bool = False
    #: The engine reads the policy's GPU memory: it shares the trainer's GPU, one GPU's
    #: buffer, so no tensor parallelism (ipc).
    same_gpu: bool = False


TRANSPORTS: dict[str, TransportSpec] = {
    spec.name: spec
    for spec in (
        TransportSpec("disk", "sync.transports.disk:DiskTransport"),
        TransportSpec("gloo", "sync.transports.broadcast:BroadcastTransport", group=True),
        TransportSpec("nccl", "sync.transports.broadcast:BroadcastTransport", group=True),
        TransportSpec("ipc", "sync.transports.ipc:IpcTransport", same_gpu=True),
    )
}

if TYPE_CHECKING:
    TransportName = Literal["disk", "gloo", "nccl", "ipc"]
else:  # the config's allowed values, from the registry (a Literal over a tuple at run time)
    TransportName = Literal[tuple(TRANSPORTS)]


def make_transport(settings: TransportSettings) -> WeightTransport:
    """The trainer half of ``settings.name``, built by its class's ``from_settings``."""
    module, cls = TRANSPORTS[settings.name].trainer_half.split(":")
    transport_cls: Any = getattr(importlib.import_module(module), cls)
    return transport_cls.from_settings(settings)
