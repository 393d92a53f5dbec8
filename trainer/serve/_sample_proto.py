"""The protobuf ``SampleResponse`` that ``/api/v1/retrieve_future`` answers for a sample, by
hand, as :mod:`trainer.serve._proto` writes ``ForwardBackwardOutput``.

The SDK (``tinker==0.38.0``) accepts a ``SampleResponse`` only as protobuf (its
``PROTO_SUPPORTED_TYPES``). Field numbers from its descriptor
(``tinker/proto/tinker_public_pb2.py``): ``SampleResponse`` 1 ``sequences`` (repeated
``SampledSequence``), 2 ``prompt_logprobs`` (float32 bytes, NaN where none); ``SampledSequence``
1 ``stop_reason`` (enum: 0 stop, 1 length), 2 ``tokens`` (int32 bytes), 3 ``logprobs`` (float32
bytes).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np

from trainer.serve._proto import _put, _put_int

__all__ = ["STOP_REASONS", "SequenceOut", "encode_sample_response"]

#: ``tinker_public.StopReason`` by the SDK's name.
STOP_REASONS = {"stop": 0, "length": 1}


@attrs.frozen
class SequenceOut:
    """One sampled sequence: its tokens, each token's logprob and why it ended."""

    tokens: Sequence[int]
    logprobs: Sequence[float]
    stop_reason: str


def encode_sample_response(
    sequences: Sequence[SequenceOut], prompt_logprobs: Sequence[float | None] | None = None
) -> bytes:
    """A ``SampleResponse`` of ``sequences``; ``prompt_logprobs`` (one per prompt token, None
    where there is none: the first) when the request asked for them."""
    out = b""
    for seq in sequences:
        body = _put_int(1, STOP_REASONS[seq.stop_reason])
        body += _put(2, np.asarray(seq.tokens, dtype="<i4").tobytes())
        body += _put(3, np.asarray(seq.logprobs, dtype="<f4").tobytes())
        out += _put(1, body)
    if prompt_logprobs is not None:
        values = [np.nan if v is None else v for v in prompt_logprobs]
        out += _put(2, np.asarray(values, dtype="<f4").tobytes())
    return out
