"""How weights travel from policy rank 0 to the engines: in memory, through files, a
collective (gloo, nccl) or CUDA IPC."""

from sync.transports.base import Rank0, WeightTransport
from sync.transports.broadcast import BroadcastTransport
from sync.transports.disk import DiskTransport
from sync.transports.inprocess import InProcessTransport
from sync.transports.ipc import IpcTransport

__all__ = [
    "BroadcastTransport",
    "DiskTransport",
    "InProcessTransport",
    "IpcTransport",
    "Rank0",
    "WeightTransport",
]
