"""How weights travel from policy rank 0 to the engines: in memory, through files, a
collective (gloo, nccl) or CUDA IPC; and a LoRA policy's adapter, loaded by name."""

from sync.transports.base import Rank0, WeightTransport
from sync.transports.broadcast import BroadcastTransport
from sync.transports.disk import DiskTransport
from sync.transports.inprocess import InProcessTransport
from sync.transports.ipc import IpcTransport
from sync.transports.lora_adapter import LoraAdapterTransport

__all__ = [
    "BroadcastTransport",
    "DiskTransport",
    "InProcessTransport",
    "IpcTransport",
    "LoraAdapterTransport",
    "Rank0",
    "WeightTransport",
]
