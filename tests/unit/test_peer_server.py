"""The peer cache server over a real socket: exact ranges (sent by the kernel from the
cache file), the status of every miss, and keep-alive across requests."""

from __future__ import annotations

import http.client
import os
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer_sidecar.store.chunk_cache import ChunkCache
from trainer_sidecar.store.peers import PeerCaches, serve_cache

CHUNK = "ab" * 32


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, str, bytes]]:
    cache = ChunkCache(tmp_path / "cache", 1 << 30)
    data = os.urandom(3 << 20)
    cache.keep(CHUNK, data)
    token = secrets.token_hex(16)
    server = serve_cache(cache, token=token, host="127.0.0.1")
    try:
        yield f"127.0.0.1:{server.server_address[1]}", token, data
    finally:
        server.shutdown()
        server.server_close()


def get(peer: str, token: str, path: str, range_: str | None) -> tuple[int, bytes]:
    host, port = peer.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Authorization": f"Bearer {token}"} | ({"Range": range_} if range_ else {})
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def test_ranges_come_back_exact_on_one_kept_alive_connection(
    served: tuple[str, str, bytes],
) -> None:
    peer, token, data = served
    peers = PeerCaches([peer], token=token)
    peers.locate([CHUNK])
    ranges = [(0, 1), (5, (1 << 20) + 3), ((2 << 20) - 1, len(data)), (0, len(data))]
    for a, b in ranges:  # the same thread: one keep-alive connection serves them all
        assert peers.read(CHUNK, a, b) == data[a:b]
    assert get(peer, token, f"/v1/chunks/{CHUNK}", None) == (206, data)


@pytest.mark.parametrize(
    ("path", "range_", "status"),
    [
        (f"/v1/chunks/{'cd' * 32}", "bytes=0-9", 404),  # not held
        (f"/v1/chunks/{CHUNK}", f"bytes=0-{3 << 20}", 404),  # past its end
        (f"/v1/chunks/{CHUNK}", "bytes=9-3", 404),  # empty
        (f"/v1/chunks/{CHUNK}", "bytes=-5", 416),  # a form we do not serve
        ("/v1/chunks/../../etc/passwd", "bytes=0-9", 404),  # never a path
    ],
)
def test_what_is_not_served(
    served: tuple[str, str, bytes], path: str, range_: str, status: int
) -> None:
    peer, token, _ = served
    assert get(peer, token, path, range_) == (status, b"")


def test_a_wrong_token_is_refused(served: tuple[str, str, bytes]) -> None:
    peer, _, _ = served
    assert get(peer, "x" * 32, f"/v1/chunks/{CHUNK}", "bytes=0-9") == (401, b"")
