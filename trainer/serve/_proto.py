"""The protobuf messages of the Tinker protocol that this service reads and writes, by hand.

The SDK (``tinker==0.38.0``) sends ``/api/v1/forward_backward`` as a protobuf
``tinker_public.ForwardBackwardRequest`` and accepts a ``ForwardBackwardOutput`` only as
protobuf (its ``PROTO_SUPPORTED_TYPES``). The field numbers below are read from the SDK's own
descriptor (``tinker/proto/tinker_public_pb2.py``); the codec is ours, a few dozen lines of the
wire format (varints, length-delimited fields, fixed 64-bit doubles), so the trainer's
environment needs neither the SDK nor a generated module.

What is refused, as :class:`ProtoError` (the caller answers it as the client's error): image,
audio (dmel) and empty chunks, sparse (CSR) tensors, dtypes other than float32 and int64, and
bytes that are not a well-formed message.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping, Sequence

import attrs
import numpy as np

__all__ = [
    "DTYPE_FLOAT32",
    "DTYPE_INT64",
    "DatumIn",
    "ForwardBackwardIn",
    "ProtoError",
    "decode_forward_backward",
    "encode_forward_backward_output",
    "put_field",
    "put_varint_field",
]

#: ``tinker_public.DType``.
DTYPE_FLOAT32 = 1
DTYPE_INT64 = 2
_NUMPY_OF = {DTYPE_FLOAT32: np.dtype("<f4"), DTYPE_INT64: np.dtype("<i8")}

_VARINT, _FIXED64, _LEN, _FIXED32 = 0, 1, 2, 5


class ProtoError(ValueError):
    """A request body this service cannot read: malformed, or a feature it does not serve."""


@attrs.frozen
class DatumIn:
    """One ``Datum``: its model input's tokens and its ``loss_fn_inputs`` as arrays."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@attrs.frozen
class ForwardBackwardIn:
    """A ``ForwardBackwardRequest``: ``forward_only`` for ``TrainingClient.forward``."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[DatumIn]


# -- the wire format ------------------------------------------------------------------------------


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = value = 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ProtoError("truncated or overlong varint")
        b = buf[i]
        i += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, i
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """``(field number, wire type, value)`` of each field in ``buf``, in order."""
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _varint(buf, i)
            yield number, wire, value
        elif wire == _LEN:
            size, i = _varint(buf, i)
            if i + size > len(buf):
                raise ProtoError("truncated length-delimited field")
            yield number, wire, buf[i : i + size]
            i += size
        elif wire == _FIXED64:
            if i + 8 > len(buf):
                raise ProtoError("truncated fixed64 field")
            yield number, wire, buf[i : i + 8]
            i += 8
        elif wire == _FIXED32:
            if i + 4 > len(buf):
                raise ProtoError("truncated fixed32 field")
            yield number, wire, buf[i : i + 4]
            i += 4
        else:
            raise ProtoError(f"unknown wire type {wire}")


def _as_bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtoError("expected a length-delimited field")
    return value


def _as_int(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise ProtoError("expected a varint field")
    return value


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def _repeated_ints(wire: int, value: int | bytes) -> list[int]:
    """A repeated integer field's values: packed (one length-delimited run) or one varint."""
    if wire == _VARINT:
        return [_signed(_as_int(value))]
    out: list[int] = []
    buf, i = _as_bytes(value), 0
    while i < len(buf):
        v, i = _varint(buf, i)
        out.append(_signed(v))
    return out


def _map_entry(buf: bytes) -> tuple[str, int | bytes | None]:
    key, val = "", None
    for number, _, value in _fields(buf):
        if number == 1:
            key = _as_bytes(value).decode()
        elif number == 2:
            val = value
    return key, val


# -- reading a ForwardBackwardRequest -------------------------------------------------------------


def _tensor(buf: bytes, name: str) -> np.ndarray:
    dense, dtype, shape = None, 0, []
    for number, wire, value in _fields(buf):
        if number == 1:
            dense = _as_bytes(value)
        elif number == 2:
            raise ProtoError(f"loss_fn_inputs[{name!r}] is a sparse (CSR) tensor: not served yet")
        elif number == 3:
            dtype = _as_int(value)
        elif number == 4:
            shape.extend(_repeated_ints(wire, value))
    if dtype not in _NUMPY_OF:
        raise ProtoError(f"loss_fn_inputs[{name!r}] has dtype {dtype}: float32 or int64 only")
    np_dtype = _NUMPY_OF[dtype]
    raw = dense or b""
    if len(raw) % np_dtype.itemsize:
        raise ProtoError(f"loss_fn_inputs[{name!r}]: {len(raw)} bytes is not whole elements")
    array = np.frombuffer(raw, dtype=np_dtype).copy()
    if shape:
        if int(np.prod(shape)) != array.size:
            raise ProtoError(f"loss_fn_inputs[{name!r}]: shape {shape} for {array.size} values")
        array = array.reshape(shape)
    return array


def _chunk_tokens(buf: bytes) -> list[int]:
    for number, _, value in _fields(buf):
        if number == 1:  # encoded_text
            for n, _, tokens in _fields(_as_bytes(value)):
                if n == 1:
                    return np.frombuffer(_as_bytes(tokens), dtype="<i4").tolist()
            return []
        kind = {2: "image", 3: "audio (dmel)"}.get(number, f"field {number}")
        raise ProtoError(f"a model input chunk of {kind}: only token chunks are served")
    raise ProtoError("an empty model input chunk")


def _datum(buf: bytes) -> DatumIn:
    tokens: list[int] = []
    inputs: dict[str, np.ndarray] = {}
    for number, _, value in _fields(buf):
        if number == 1:
            tokens.extend(_chunk_tokens(_as_bytes(value)))
        elif number == 2:
            name, tensor = _map_entry(_as_bytes(value))
            inputs[name] = _tensor(_as_bytes(tensor or b""), name)
    return DatumIn(tokens=tokens, inputs=inputs)


def _loss_config_value(buf: bytes) -> float | str | None:
    for number, _, value in _fields(buf):
        if number == 1:
            return struct.unpack("<d", _as_bytes(value))[0]
        if number == 2:
            return _as_bytes(value).decode()
    return None


def decode_forward_backward(body: bytes) -> ForwardBackwardIn:
    """The ``ForwardBackwardRequest`` in ``body``; :class:`ProtoError` when unreadable."""
    model_id, seq_id, loss_fn, forward_only = "", 0, "", False
    config: dict[str, float | str] = {}
    config_v2: dict[str, float | str] = {}
    data: list[DatumIn] = []
    try:
        for number, _, value in _fields(body):
            if number == 1:
                model_id = _as_bytes(value).decode()
            elif number == 2:
                seq_id = _as_int(value)
            elif number == 3:
                data.append(_datum(_as_bytes(value)))
            elif number == 4:
                loss_fn = _as_bytes(value).decode()
            elif number == 5:
                key, raw = _map_entry(_as_bytes(value))
                config[key] = struct.unpack("<d", _as_bytes(raw or bytes(8)))[0]
            elif number == 6:
                forward_only = bool(_as_int(value))
            elif number == 7:
                key, raw = _map_entry(_as_bytes(value))
                v = _loss_config_value(_as_bytes(raw or b""))
                if v is not None:
                    config_v2[key] = v
    except UnicodeDecodeError as exc:
        raise ProtoError(f"a string field is not UTF-8: {exc}") from None
    return ForwardBackwardIn(
        model_id=model_id,
        seq_id=seq_id,
        loss_fn=loss_fn,
        loss_fn_config=config | config_v2,  # the SDK writes both; v2 carries strings too
        forward_only=forward_only,
        data=data,
    )


# -- writing a ForwardBackwardOutput --------------------------------------------------------------


def _put_varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        b = value & 0x7F
        value >>= 7
        if value:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _put(number: int, payload: bytes) -> bytes:
    return _put_varint(number << 3 | _LEN) + _put_varint(len(payload)) + payload


def _put_int(number: int, value: int) -> bytes:
    return _put_varint(number << 3 | _VARINT) + _put_varint(value)


def _batched_tensor(arrays: Sequence[np.ndarray]) -> bytes:
    """A ``BatchedTensor`` of 1-D float32 arrays: their bytes end to end, byte offsets."""
    parts = [np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays]
    offsets = np.cumsum([0, *(len(p) for p in parts)], dtype="<i8")
    return (
        _put(1, b"".join(parts)) + _put(2, offsets.tobytes()) + _put_int(3, DTYPE_FLOAT32)
    )  # trailing_shape empty: each datum's array is 1-D


def encode_forward_backward_output(
    outputs: Sequence[Mapping[str, np.ndarray]], metrics: Mapping[str, float]
) -> bytes:
    """A ``ForwardBackwardOutput``: one ``ArrayRecord`` holding each datum's 1-D float32
    arrays (the same names in every datum), and the metrics."""
    names = list(outputs[0]) if outputs else []
    record = _put(1, b"ArrayRecord")
    for name in names:
        entry = _put(1, name.encode()) + _put(2, _batched_tensor([o[name] for o in outputs]))
        record += _put(2, entry)
    record += _put_int(3, len(outputs))
    out = _put(1, b"ArrayRecord") + _put(2, record)
    for key, value in metrics.items():
        entry = _put(1, key.encode()) + _put_varint(2 << 3 | _FIXED64) + struct.pack("<d", value)
        out += _put(3, entry)
    return out


#: The wire format's writers, for the other messages of the package (``_sample_io``).
put_field = _put
put_varint_field = _put_int
