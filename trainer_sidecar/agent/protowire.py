"""Protocol Buffers' wire format, for the few small messages the node agent's CSI endpoint
speaks with the kubelet (agent/csi.py): strings, bools, string maps and nested messages.

The CSI spec (csi.proto, package ``csi.v1``) and the kubelet's plugin registration API
(``pluginregistration``) are protobuf over gRPC. Their messages that the agent reads or
writes hold only these field types, so a message here is a ``Fields`` (field number ->
the values it appeared with, in order) and no generated code or protobuf runtime is
needed. Unknown fields are kept and ignored, as protobuf's own readers do, so a newer
kubelet's extra fields do no harm. Any malformed input raises ``WireError``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

Fields = dict[int, list[int | bytes]]
"""A decoded message: field number -> its values (varints as int, the rest as bytes)."""

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
MAX_MESSAGE = 4 << 20
"""gRPC's own default limit on a received message."""


class WireError(ValueError):
    """The bytes are not a protobuf message of the shape expected."""


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(data) or shift > 63:
            raise WireError("a varint runs past the message's end or 10 bytes")
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, at
        shift += 7


def decode(data: bytes) -> Fields:
    """Every field of one message."""
    if len(data) > MAX_MESSAGE:
        raise WireError(f"a message of {len(data)} bytes (at most {MAX_MESSAGE})")
    fields: Fields = {}
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        number, kind = key >> 3, key & 7
        value: int | bytes
        if number == 0:
            raise WireError("field number 0")
        if kind == _VARINT:
            value, at = _varint(data, at)
        elif kind == _LEN:
            size, at = _varint(data, at)
            if at + size > len(data):
                raise WireError("a length-delimited field runs past the message's end")
            value, at = data[at : at + size], at + size
        elif kind in (_I64, _I32):
            width = 8 if kind == _I64 else 4
            if at + width > len(data):
                raise WireError("a fixed-width field runs past the message's end")
            value, at = int.from_bytes(data[at : at + width], "little"), at + width
        else:
            raise WireError(f"wire type {kind} (groups are not used by these APIs)")
        fields.setdefault(number, []).append(value)
    return fields


def _last(fields: Fields, number: int) -> int | bytes | None:
    values = fields.get(number)
    return values[-1] if values else None  # proto3: the last value of a scalar wins


def string(fields: Fields, number: int) -> str:
    """A string field ('' when absent)."""
    value = _last(fields, number)
    if value is None:
        return ""
    if not isinstance(value, bytes):
        raise WireError(f"field {number} is a varint, not a string")
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise WireError(f"field {number} is not UTF-8") from None


def boolean(fields: Fields, number: int) -> bool:
    value = _last(fields, number)
    if isinstance(value, bytes):
        raise WireError(f"field {number} is length-delimited, not a bool")
    return bool(value)


def message(fields: Fields, number: int) -> Fields:
    """A nested message field (empty when absent)."""
    value = _last(fields, number)
    if value is None:
        return {}
    if not isinstance(value, bytes):
        raise WireError(f"field {number} is a varint, not a message")
    return decode(value)


def string_map(fields: Fields, number: int) -> dict[str, str]:
    """A ``map<string, string>`` field: repeated entries of (key = 1, value = 2)."""
    out: dict[str, str] = {}
    for entry in fields.get(number, []):
        if not isinstance(entry, bytes):
            raise WireError(f"field {number} is a varint, not a map entry")
        parsed = decode(entry)
        out[string(parsed, 1)] = string(parsed, 2)
    return out


# -- writing ------------------------------------------------------------------------------


def _encode_varint(value: int) -> bytes:
    if value < 0:
        value &= (1 << 64) - 1  # int64's two's complement, as protobuf writes it
    out = bytearray()
    while True:
        low = value & 0x7F
        value >>= 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def _key(number: int, kind: int) -> bytes:
    return _encode_varint(number << 3 | kind)


def encode_bytes(number: int, value: bytes) -> bytes:
    """A length-delimited field: a string's UTF-8, or an encoded nested message."""
    return _key(number, _LEN) + _encode_varint(len(value)) + value


def encode_string(number: int, value: str) -> bytes:
    """A string field; proto3 leaves out an empty one."""
    return encode_bytes(number, value.encode()) if value else b""


def encode_strings(number: int, values: Iterable[str]) -> bytes:
    """A ``repeated string`` field (every value written, empty ones too)."""
    return b"".join(encode_bytes(number, v.encode()) for v in values)


def encode_bool(number: int, value: bool) -> bytes:
    return _key(number, _VARINT) + b"\x01" if value else b""


def encode_int(number: int, value: int) -> bytes:
    return _key(number, _VARINT) + _encode_varint(value) if value else b""


def encode_map(number: int, values: Mapping[str, str]) -> bytes:
    return b"".join(
        encode_bytes(number, encode_string(1, k) + encode_string(2, v))
        for k, v in sorted(values.items())
    )
