"""The peer cache server and client over real sockets: exact ranges (sent by the kernel from
the cache file), the status of every miss, keep-alive across requests; and the deadlines and
bounds of both sides (store/peer_limits.py): a server that closes idle, trickling and excess
connections and answers a bad or unauthenticated request at once, a client for which a
slow, silent or oversized peer is a miss within its deadline, read no further than asked."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import socket
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.load.tiers import PEER_PHASES, restore_bound_s
from trainer_sidecar.store.chunk_cache import ChunkCache
from trainer_sidecar.store.peer_limits import PeerClientLimits, PeerServerLimits, WasteMeter
from trainer_sidecar.store.peers import PeerCaches, serve_cache

CHUNK = "ab" * 32
# short deadlines and a small cap, so that the tests wait fractions of a second
SERVER = PeerServerLimits(
    header_deadline_s=0.5, body_deadline_s=0.5, send_deadline_s=5.0, max_connections=4
)
CLIENT = PeerClientLimits(request_deadline_s=1.0, locate_deadline_s=1.0, restore_budget_s=30.0)
SLACK_S = 1.5  # on top of a deadline: these machines are shared and noisy


Served = tuple[str, str, bytes]


def _serve(root: Path) -> Iterator[Served]:
    cache = ChunkCache(root / "cache", 1 << 30)
    data = os.urandom(3 << 20)
    cache.keep(CHUNK, data)
    token = secrets.token_hex(16)
    server = serve_cache(cache, token=token, host="127.0.0.1", limits=SERVER)
    try:
        yield f"127.0.0.1:{server.server_address[1]}", token, data
    finally:
        server.shutdown()  # (up to half a second: one server for the module)
        server.server_close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the tests that leave no connection open behind them."""
    yield from _serve(tmp_path_factory.mktemp("served"))


@pytest.fixture
def served_alone(tmp_path: Path) -> Iterator[Served]:
    """A server of the test's own: it counts connections."""
    yield from _serve(tmp_path)


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


def connect(peer: str) -> socket.socket:
    host, port = peer.split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def closed_after(sock: socket.socket, within: float) -> tuple[float, bytes]:
    """(seconds until the server closed ``sock``, what it sent before); fails past ``within``."""
    start = time.monotonic()
    got = b""
    sock.settimeout(within)
    try:
        while chunk := sock.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server still held the connection after {within}s (sent {got!r})")
    return time.monotonic() - start, got


def status_line(sock: socket.socket, within: float) -> bytes:
    sock.settimeout(within)
    line = b""
    try:
        while not line.endswith(b"\r\n") and (byte := sock.recv(1)):
            line += byte
    except TimeoutError:
        pytest.fail(f"no answer within {within}s (got {line!r})")
    return line


def test_ranges_come_back_exact_on_one_kept_alive_connection(served: Served) -> None:
    peer, token, data = served
    peers = PeerCaches([peer], token=token, limits=CLIENT)
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
        (f"/v1/chunks/{CHUNK}", "bytes=0-9, 20-29", 416),  # several ranges: neither
        (f"/v1/chunks/{CHUNK}", "bytes=0-" + "9" * 5000, 416),  # a number no file reaches
        ("/v1/chunks/../../etc/passwd", "bytes=0-9", 404),  # never a path
    ],
)
def test_what_is_not_served(served: Served, path: str, range_: str, status: int) -> None:
    peer, token, _ = served
    assert get(peer, token, path, range_) == (status, b"")


@pytest.mark.parametrize(
    "authorization",
    ["Bearer " + "x" * 32, "", "Bearer ", "{token}", "Basic {token}", "Bearer {token}x"],
)
def test_anything_but_the_bearer_token_is_refused(served: Served, authorization: str) -> None:
    peer, token, _ = served
    host, port = peer.split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", f"/v1/chunks/{CHUNK}", headers={
            "Authorization": authorization.format(token=token), "Range": "bytes=0-9",
        })  # fmt: skip
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (401, b"")
    finally:
        conn.close()


# -- the server's deadlines and bounds --------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_at_its_header_deadline(
    served: Served,
) -> None:
    peer, _, _ = served
    with connect(peer) as sock:
        elapsed, _ = closed_after(sock, SERVER.header_deadline_s + SLACK_S)
    assert elapsed >= SERVER.header_deadline_s * 0.8


def test_headers_trickled_a_byte_at_a_time_are_cut_off_at_the_header_deadline(
    served: Served,
) -> None:
    """Each byte comes well within any per-receive timeout; the request never ends."""
    peer, token, _ = served
    stop = threading.Event()

    def trickle(sock: socket.socket) -> None:
        sock.sendall(f"GET /v1/chunks/{CHUNK} HTTP/1.1\r\nAuthorization: Bearer {token}\r\n"
                     .encode())  # fmt: skip
        with contextlib.suppress(OSError):
            while not stop.wait(0.05):
                sock.sendall(b"X")

    with connect(peer) as sock:
        sender = threading.Thread(target=trickle, args=(sock,), daemon=True)
        sender.start()
        try:
            elapsed, got = closed_after(sock, SERVER.header_deadline_s + SLACK_S)
        finally:
            stop.set()
            sender.join()
    assert elapsed < SERVER.header_deadline_s + SLACK_S
    assert not got.startswith(b"HTTP/1.1 2"), got


def test_connections_past_the_cap_are_refused_at_once_and_requests_served_once_idle_ones_go(
    served_alone: Served,
) -> None:
    peer, token, data = served_alone
    idle = [connect(peer) for _ in range(SERVER.max_connections)]
    try:
        with connect(peer) as extra:  # one too many: answered and closed at once
            elapsed, got = closed_after(extra, 0.5)
            assert got == b"" or got.startswith(b"HTTP/1.1 503"), got
        # the idle ones are closed at their deadline; then a request is served again
        for sock in idle:
            closed_after(sock, SERVER.header_deadline_s + SLACK_S)
        peers = PeerCaches([peer], token=token, limits=CLIENT)
        peers.locate([CHUNK])
        assert peers.read(CHUNK, 10, 20) == data[10:20]
    finally:
        for sock in idle:
            sock.close()


@pytest.mark.parametrize("length", ["-1", "abc", "1e3", "0x10", "+5", "5, 5"])
def test_a_bad_content_length_is_answered_400_at_once(served: Served, length: str) -> None:
    peer, token, _ = served
    with connect(peer) as sock:
        sock.sendall(f"POST /v1/has HTTP/1.1\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Length: {length}\r\n\r\n".encode())  # fmt: skip
        assert status_line(sock, 1.0).startswith(b"HTTP/1.1 400"), length
        closed_after(sock, 1.0)


def test_a_body_too_large_is_refused_before_it_is_read(served: Served) -> None:
    peer, token, _ = served
    with connect(peer) as sock:
        sock.sendall(f"POST /v1/has HTTP/1.1\r\nAuthorization: Bearer {token}\r\n"
                     f"Content-Length: {SERVER.max_body_bytes + 1}\r\n\r\n".encode())  # fmt: skip
        assert status_line(sock, 1.0).startswith(b"HTTP/1.1 413")


def test_a_body_that_never_comes_is_cut_off_at_the_body_deadline(served: Served) -> None:
    peer, token, _ = served
    with connect(peer) as sock:
        sock.sendall(f"POST /v1/has HTTP/1.1\r\nAuthorization: Bearer {token}\r\n"
                     "Content-Length: 100\r\n\r\n{".encode())  # fmt: skip
        closed_after(sock, SERVER.body_deadline_s + SLACK_S)


@pytest.mark.parametrize("length", ["1000000000", "garbage"])
def test_an_unauthenticated_request_is_answered_401_before_its_body(
    served: Served, length: str
) -> None:
    """Not even a 100 Continue: the body is never asked for, nor read."""
    peer, _, _ = served
    with connect(peer) as sock:
        sock.sendall(f"POST /v1/has HTTP/1.1\r\nContent-Length: {length}\r\n"
                     "Expect: 100-continue\r\n\r\n".encode())  # fmt: skip
        assert status_line(sock, 1.0).startswith(b"HTTP/1.1 401")
        elapsed, _ = closed_after(sock, 1.0)


# -- the client: a misbehaving peer is a miss, within its deadline, read no further ----


class FakePeer:
    """A peer cache server that misbehaves. It answers ``POST /v1/has`` at once, holding
    every id asked, and every GET as ``mode`` says:

    - ``trickle``: a right answer, one byte every ``every_s`` (until closed);
    - ``oversize``: 206 with a Content-Length of ``flood`` bytes, streamed until the
      reader hangs up;
    - ``endless``: 206 without a Content-Length, streamed until the reader hangs up.

    ``sent``: the body bytes the kernel took on each GET's connection; ``gets``: the
    GETs that came; ``wait_answered``: until that many GETs are answered (or given up)."""

    def __init__(self, mode: str, *, every_s: float = 0.5, flood: int = 64 << 20) -> None:
        self.mode, self.every_s, self.flood = mode, every_s, flood
        self.gets = 0
        self.sent: list[int] = []
        self._answered = threading.Semaphore(0)
        self.stop = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self.listener.close()

    def wait_answered(self, count: int, within: float) -> None:
        for _ in range(count):
            assert self._answered.acquire(timeout=within), "the fake peer is still sending"

    def __enter__(self) -> FakePeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self.stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError, ValueError), conn.makefile("rb") as reader:
            while request := reader.readline():
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode().partition(":")
                    headers[name.strip().lower()] = value.strip()
                body = reader.read(int(headers.get("content-length", "0")))
                if request.startswith(b"POST"):
                    held = json.dumps({"ids": json.loads(body)["ids"]}).encode()
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(held), held))  # fmt: skip
                    continue
                self.gets += 1
                a, b = (int(x) for x in headers["range"].removeprefix("bytes=").split("-"))
                self.sent.append(0)
                try:
                    getattr(self, f"_{self.mode}")(conn, b + 1 - a)
                finally:
                    self._answered.release()
                return

    def _trickle(self, conn: socket.socket, size: int) -> None:
        answer = b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % size
        for byte in answer + b"\0" * size:
            conn.sendall(bytes([byte]))
            if self.stop.wait(self.every_s):
                return

    def _oversize(self, conn: socket.socket, size: int) -> None:
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n\r\n" % self.flood)
        self._flood(conn)

    def _endless(self, conn: socket.socket, size: int) -> None:
        conn.sendall(b"HTTP/1.1 206 Partial Content\r\nConnection: close\r\n\r\n")
        self._flood(conn)

    def _flood(self, conn: socket.socket) -> None:
        piece = b"\0" * (64 << 10)
        while self.sent[-1] < self.flood and not self.stop.is_set():
            self.sent[-1] += conn.send(piece)


@pytest.fixture
def fake_peer() -> Iterator[Callable[..., FakePeer]]:
    made: list[FakePeer] = []

    def make(mode: str, **options: int | float) -> FakePeer:
        made.append(FakePeer(mode, **options))  # type: ignore[arg-type]
        return made[-1]

    yield make
    for peer in made:
        peer.close()


def timed_read(peers: PeerCaches, start: int, end: int) -> tuple[float, bytes | None]:
    t0 = time.monotonic()
    data = peers.read(CHUNK, start, end)
    return time.monotonic() - t0, data


def test_a_peer_that_trickles_is_a_miss_within_the_whole_request_deadline_and_not_asked_again(
    fake_peer: Callable[..., FakePeer],
) -> None:
    slow = fake_peer("trickle", every_s=0.5)
    peers = PeerCaches([slow.address], token="t" * 32, limits=CLIENT)
    peers.locate([CHUNK])
    elapsed, data = timed_read(peers, 0, 10)
    assert data is None
    assert elapsed < CLIENT.deadline_s(10) + SLACK_S
    elapsed, data = timed_read(peers, 0, 10)  # missed for timing: skipped this restore
    assert data is None and elapsed < 0.1 and slow.gets == 1


@pytest.mark.parametrize("mode", ["oversize", "endless"])
def test_a_peer_that_sends_more_than_the_range_is_a_miss_without_reading_it(
    fake_peer: Callable[..., FakePeer], mode: str
) -> None:
    big = fake_peer(mode)
    peers = PeerCaches([big.address], token="t" * 32, limits=CLIENT)
    peers.locate([CHUNK])
    tracemalloc.start()
    try:
        elapsed, data = timed_read(peers, 0, 1024)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert data is None
    assert peak < 4 << 20, peak  # never the 64 MiB the peer offered
    big.wait_answered(1, within=10)  # its sends fail once the reader has hung up
    assert max(big.sent) < big.flood // 2, big.sent  # it hung up: the kernel's buffers took some


def test_peers_are_skipped_once_their_misses_have_cost_the_restore_its_budget(
    fake_peer: Callable[..., FakePeer],
) -> None:
    """Each peer misses once, for timing, and is dropped; once the time lost passes the
    restore's budget, no peer is asked at all: the next peer is never contacted."""
    slow = [fake_peer("trickle", every_s=0.5) for _ in range(3)]
    limits = PeerClientLimits(request_deadline_s=0.5, locate_deadline_s=1.0, restore_budget_s=0.8)
    peers = PeerCaches([p.address for p in slow], token="t" * 32, limits=limits)
    peers.locate([CHUNK])
    elapsed, data = timed_read(peers, 0, 10)
    assert data is None
    assert [p.gets for p in slow] == [1, 1, 0]  # 0.5 s lost, then 1.0 s: over 0.8
    assert elapsed < limits.restore_budget_s + limits.deadline_s(10) + SLACK_S
    assert peers.read(CHUNK, 0, 10) is None and [p.gets for p in slow] == [1, 1, 0]
    assert peers.wasted_s >= limits.restore_budget_s
    # the next restore (or replication round) starts afresh
    again = peers.renewed(restore_budget_s=0.1)
    again.locate([CHUNK])
    assert again.read(CHUNK, 0, 10) is None and [p.gets for p in slow] == [2, 1, 0]


def test_limits_are_checked_when_made_and_read_from_the_environment() -> None:
    with pytest.raises(CheckpointError, match="header_deadline_s"):
        PeerServerLimits(header_deadline_s=0)
    with pytest.raises(CheckpointError, match="max_connections"):
        PeerServerLimits(max_connections=0)
    with pytest.raises(CheckpointError, match="restore_budget_s"):
        PeerClientLimits(restore_budget_s=-1)
    env = {"CTJ_PEER_MAX_CONNECTIONS": "8", "CTJ_PEER_HEADER_DEADLINE_S": "2.5"}
    assert PeerServerLimits.from_env(env) == PeerServerLimits(
        max_connections=8, header_deadline_s=2.5
    )
    assert PeerClientLimits.from_env({"CTJ_PEER_RESTORE_BUDGET_S": "3"}).restore_budget_s == 3
    with pytest.raises(CheckpointError, match="CTJ_PEER_MAX_CONNECTIONS"):
        PeerServerLimits.from_env({"CTJ_PEER_MAX_CONNECTIONS": "many"})
    # the documented bound: the budget, then the longest request already under way
    limits = PeerClientLimits()
    assert limits.bound_s(8 << 20) == limits.restore_budget_s + max(
        limits.locate_deadline_s, limits.deadline_s(8 << 20)
    )
    assert restore_bound_s(limits, 8 << 20, 2) == 2 * PEER_PHASES * limits.bound_s(8 << 20)


def test_the_waste_meter_counts_overlapping_spans_once() -> None:
    """Five threads waiting on peers for the same second waste the restore one second."""
    meter = WasteMeter()
    for span in [(10, 11), (10.2, 11), (10.5, 10.6), (0, 1), (12, 13), (10.9, 12.5)]:
        meter.charge(*span)
    assert meter.spent == pytest.approx(1 + 3)  # [0, 1] and [10, 13]
    meter.charge(5, 5)  # nothing
    meter.charge(2, 1)
    assert meter.spent == pytest.approx(4)
    meter.charge(-1, 20)  # all of it, once
    assert meter.spent == pytest.approx(21)
