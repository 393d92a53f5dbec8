"""How weights travel from policy rank 0 to the engines: in memory, through files, or broadcast."""

from sync.transports.base import Rank0, WeightTransport
from sync.transports.broadcast import BroadcastTransport
from sync.transports.disk import DiskTransport
from sync.transports.inprocess import InProcessTransport

__all__ = ["BroadcastTransport", "DiskTransport", "InProcessTransport", "Rank0", "WeightTransport"]
