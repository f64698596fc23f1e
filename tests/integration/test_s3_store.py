"""What our PUTs carry to a real S3 server: a CRC32 of the body, no body hash in the signature."""

from __future__ import annotations

import base64
import os
import zlib
from typing import Any

import pytest

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
