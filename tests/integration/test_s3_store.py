"""What our PUTs carry to a real S3 server: a CRC32 of the body, no body hash in the signature."""

from __future__ import annotations

import base64
import os
import zlib
from typing import Any

import pytest

from trainer_sidecar.errors import ObjectNotFound
from trainer_sidecar.store.base import Location
from trainer_sidecar.store.s3 import S3Settings, S3Store

pytestmark = pytest.mark.integration


def test_put_sends_the_bodys_crc32_and_an_unsigned_payload(s3_uri: str) -> None:
    store = S3Store(Location.parse(s3_uri), S3Settings.from_env())
    seen: list[dict[str, bytes]] = []

    def capture(request: Any, **_: Any) -> None:
        seen.append(dict(request.headers))

    store._s3.meta.events.register("before-send.s3.PutObject", capture)
    body = os.urandom(3 << 20)
    store.put("chunks/ab/x", memoryview(body)[1:])  # a view, as the uploader sends
    assert store.get("chunks/ab/x") == body[1:]
    (headers,) = seen
    want = base64.b64encode(zlib.crc32(body[1:]).to_bytes(4, "big"))
    assert headers["x-amz-checksum-crc32"] == want
    assert headers["X-Amz-Content-SHA256"] == b"UNSIGNED-PAYLOAD"


def test_get_into_reads_a_range_straight_into_the_buffer(s3_uri: str) -> None:
    """The body goes from the socket into the caller's buffer (http.client's readinto, not
    urllib3's read-and-copy), and the connection is reused after it: this fails if the
    pinned botocore/urllib3 lose the private attributes the direct path reads."""
    from trainer_sidecar.store import s3 as s3_module

    store = S3Store(Location.parse(s3_uri), S3Settings.from_env())
    body = os.urandom((3 << 20) + 7)
    store.put("chunks/cd/y", body)
    resp = store._s3.get_object(Bucket=store.bucket, Key=store.prefix + "chunks/cd/y")
    assert s3_module._socket_reader(resp["Body"]) is not None
    resp["Body"].close()

    opened: list[object] = []
    store._s3.meta.events.register("before-send.s3.GetObject", lambda **kw: opened.append(1))
    manager = store._s3._endpoint.http_session._manager  # botocore's urllib3 PoolManager
    pool = manager.connection_from_url(store._s3.meta.endpoint_url)
    made = pool.num_connections
    for start, end in [(0, len(body)), (1 << 20, 2 << 20), (5, 9)] * 10:
        into = bytearray(end - start)
        assert (
            store.get_into("chunks/cd/y", [memoryview(into)], byte_range=(start, end))
            == end - start
        )
        assert into == body[start:end]
    assert len(opened) == 30
    assert pool.num_connections - made <= 1  # each body read to its end: the connection kept
    # one body scattered over several buffers, each filled before the next
    parts = [bytearray(5), bytearray(0), bytearray(1 << 20), bytearray(3)]
    n = store.get_into(
        "chunks/cd/y", [memoryview(p) for p in parts], byte_range=(7, (1 << 20) + 15)
    )
    assert n == (1 << 20) + 8 and b"".join(parts) == body[7 : (1 << 20) + 15]
    # the pool still answers after 30 direct reads, interleaved with ordinary GETs
    assert store.get("chunks/cd/y", byte_range=(0, 10)) == body[:10]


def test_get_into_tells_a_larger_object_without_reading_it(s3_uri: str) -> None:
    """A range that holds more than the buffer: its length back, the buffer untouched (the
    reader asks one byte more than a chunk's size to refuse an object larger than it)."""
    store = S3Store(Location.parse(s3_uri), S3Settings.from_env())
    store.put("chunks/ef/z", b"x" * 101)
    into = bytearray(100)
    assert store.get_into("chunks/ef/z", [memoryview(into)], byte_range=(0, 101)) == 101
    assert into == bytes(100)
    assert store.get_into("chunks/ef/z", [memoryview(into)], byte_range=(0, 100)) == 100
    assert into == b"x" * 100
    short = bytearray(200)  # the object ends first: what it has
    assert store.get_into("chunks/ef/z", [memoryview(short)], byte_range=(0, 200)) == 101
    assert store.get_into("chunks/ef/z", [memoryview(short)], byte_range=(500, 600)) == 0
    with pytest.raises(ObjectNotFound):
        store.get_into("chunks/ef/none", [memoryview(short)], byte_range=(0, 10))
