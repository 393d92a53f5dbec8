"""How the trainer and a reward worker process talk: pickles, each after its length.

Each message is ``HEADER.pack(len(data)) + data`` with ``data = pickle.dumps(message)``: a
4-byte big-endian length, then the pickle. Both sides hold only values they made themselves
(the worker is the trainer's own child), so unpickling is not a trust boundary.
"""

from __future__ import annotations

import pickle
import struct

__all__ = ["HEADER", "frame"]

HEADER = struct.Struct("!I")


def frame(message: object) -> bytes:
    """``message`` as the bytes one write puts on the pipe."""
    data = pickle.dumps(message)
    return HEADER.pack(len(data)) + data
