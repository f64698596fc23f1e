"""The protobuf wire codec of the node agent's CSI endpoint (trainer_sidecar/agent/protowire.py),
against the encodings protobuf's own documentation gives, and hostile input."""

from __future__ import annotations

import pytest

from trainer_sidecar.agent import protowire as pw


def test_the_documented_encodings() -> None:
    # protobuf's encoding guide: field 1 = 150 is 08 96 01; field 2 = "testing" is 12 07 ...
    assert pw.encode_int(1, 150) == bytes.fromhex("089601")
    assert pw.encode_string(2, "testing") == bytes.fromhex("120774657374696e67")
    # a nested message: field 3 holding the first
    assert pw.encode_bytes(3, pw.encode_int(1, 150)) == bytes.fromhex("1a03089601")
    fields = pw.decode(bytes.fromhex("089601120774657374696e671a03089601"))
    assert fields[1] == [150] and pw.string(fields, 2) == "testing"
    assert pw.message(fields, 3) == {1: [150]}
    assert pw.encode_int(1, -1) == bytes.fromhex("08ffffffffffffffffff01")  # int64's -1


def test_a_round_trip_of_what_the_csi_messages_hold() -> None:
    body = (
        pw.encode_string(1, "vol-1")
        + pw.encode_string(4, "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/v/mount")
        + pw.encode_bool(6, True)
        + pw.encode_map(8, {"job": "démo", "uid": "u-1", "empty": ""})
        + pw.encode_strings(9, ["1.0.0", ""])
    )
    fields = pw.decode(body)
    assert pw.string(fields, 1) == "vol-1" and pw.boolean(fields, 6)
    assert pw.string_map(fields, 8) == {"job": "démo", "uid": "u-1", "empty": ""}
    assert fields[9] == [b"1.0.0", b""]
    # absent fields read as proto3's defaults; proto3 writes no default value
    assert pw.string(fields, 2) == "" and not pw.boolean(fields, 3) and pw.message(fields, 5) == {}
    assert pw.encode_string(1, "") == pw.encode_bool(1, False) == pw.encode_int(1, 0) == b""
    # fixed-width fields of a newer peer are skipped, not refused
    assert pw.decode(bytes.fromhex("0d01000000")) == {1: [1]}
    assert pw.decode(bytes.fromhex("090100000000000000")) == {1: [1]}


@pytest.mark.parametrize(
    "raw, why",
    [
        ("0a05616263", "a string shorter than its length"),
        ("08ff", "a varint cut off"),
        ("08" + "ff" * 10 + "01", "a varint of 11 bytes"),
        ("0b", "a group (wire type 3)"),
        ("00", "field number 0"),
        ("0d0100", "a fixed32 cut off"),
    ],
)
def test_malformed_input_is_a_wire_error(raw: str, why: str) -> None:
    with pytest.raises(pw.WireError):
        pw.decode(bytes.fromhex(raw))


def test_a_field_of_the_wrong_kind_is_a_wire_error() -> None:
    fields = pw.decode(pw.encode_int(1, 5) + pw.encode_string(2, "x") + bytes.fromhex("1a01ff"))
    for read in (lambda: pw.string(fields, 1), lambda: pw.message(fields, 1),
                 lambda: pw.boolean(fields, 2), lambda: pw.string(fields, 3),
                 lambda: pw.string_map(fields, 1)):  # fmt: skip
        with pytest.raises(pw.WireError):
            read()
    with pytest.raises(pw.WireError):
        pw.decode(b"\x0a" + b"\x80\x80\x80\x02" + b"x")  # a 4 MiB length: past the end
    with pytest.raises(pw.WireError, match="at most"):
        pw.decode(bytes(pw.MAX_MESSAGE + 1))
