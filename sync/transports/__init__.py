"""How weights travel from policy rank 0 to the engines: in memory, or through files."""

from sync.transports.base import WeightTransport
from sync.transports.disk import DiskTransport
from sync.transports.inprocess import InProcessTransport

__all__ = ["DiskTransport", "InProcessTransport", "WeightTransport"]
