"""The peer protocol on the wire, with a wall-clock deadline on every wait.

A socket timeout bounds one receive, so a peer that sends a byte now and then holds a
reader for ever. Here every receive and send first sets the socket's timeout to what is
left of a ``Deadline`` (and fails once nothing is), so a whole phase (a request's
headers, its body, an answer) is bounded, however the bytes trickle. The server
(store/peers.py) reads through ``buffered_reader`` and writes through ``DeadlineWriter``
and ``send_file``; the client is ``PeerConnection``. The header checks both sides make
are pure functions that raise ``BadRequest`` with the status to answer.
"""

from __future__ import annotations

import hmac
import http.client
import http.server
import io
import os
import re
import select
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

MAX_LINE = 65536  # a status or request line (http.server's and http.client's bound)
_DIGITS = re.compile(r"\d{1,19}")  # a byte count (of 1-19 digits: no int of 5,000 digits)
_RANGE = re.compile(r"bytes=(\d{1,19})-(\d{1,19})")
_STATUS = re.compile(rb"HTTP/1\.[01] (\d{3})(?: [^\r\n]*)?\r?\n")


class Deadline:
    """A point in monotonic time that every wait of a phase is bounded by."""

    __slots__ = ("at", "seconds", "what")

    def __init__(self, seconds: float, what: str) -> None:
        self.at, self.seconds, self.what = 0.0, 0.0, ""
        self.reset(seconds, what)

    def reset(self, seconds: float, what: str) -> None:
        """A new phase: ``what`` (for messages) must be done within ``seconds`` from now."""
        self.at, self.seconds, self.what = time.monotonic() + seconds, seconds, what

    def left(self) -> float:
        """Seconds left; TimeoutError (naming the phase) when there are none."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{self.what} took over {self.seconds:.1f}s")
        return left


class DeadlineReader(io.RawIOBase):
    """A socket's receiving side, each receive bounded by what is left of ``deadline``
    (reassignable: the next request's)."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        self.sock.settimeout(self.deadline.left())
        try:
            return self.sock.recv_into(buf)
        except TimeoutError:
            what, seconds = self.deadline.what, self.deadline.seconds
            raise TimeoutError(f"{what} took over {seconds:.1f}s") from None


class DeadlineWriter(io.RawIOBase):
    """A socket's sending side (unbuffered), each send bounded by ``deadline``."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        super().__init__()
        self.sock, self.deadline = sock, deadline

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        send_all(self.sock, data, self.deadline)
        return memoryview(data).nbytes


def buffered_reader(sock: socket.socket, deadline: Deadline) -> io.BufferedReader:
    return io.BufferedReader(DeadlineReader(sock, deadline), 64 << 10)


def send_all(sock: socket.socket, data: bytes | memoryview, deadline: Deadline) -> None:
    # since Python 3.5 a socket timeout bounds a whole sendall, not each send in it
    sock.settimeout(deadline.left())
    try:
        sock.sendall(data)
    except TimeoutError:
        raise TimeoutError(f"{deadline.what} took over {deadline.seconds:.1f}s") from None


def send_file(sock: socket.socket, f: Any, offset: int, count: int, deadline: Deadline) -> int:
    """Bytes [offset, offset + count) of file ``f`` to ``sock`` (the kernel copies them:
    no bytes through Python), within ``deadline``; the bytes sent (fewer: the file
    shrank)."""
    sock.settimeout(deadline.left())  # a timeout makes the socket non-blocking underneath
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    sent = 0
    while sent < count:
        if not poller.poll(max(1, int(deadline.left() * 1000))):
            continue  # deadline.left() raises once it has passed
        try:
            n = os.sendfile(sock.fileno(), f.fileno(), offset + sent, min(count - sent, 1 << 30))
        except BlockingIOError:
            continue
        if n == 0:
            break
        sent += n
    return sent


# -- headers, checked (pure) ------------------------------------------------------------


class BadRequest(Exception):
    """A request (or an answer) whose headers are not what the protocol allows."""

    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


def content_length(values: Sequence[str] | None, maximum: int) -> int:
    """The one Content-Length (0 when there is none), a byte count of at most ``maximum``:
    400 for anything else (negative, signed, hex, several), 413 for too many bytes."""
    if not values:
        return 0
    if len(values) != 1:
        raise BadRequest(400, f"{len(values)} Content-Length headers")
    value = values[0].strip()
    if not _DIGITS.fullmatch(value):
        raise BadRequest(400, f"Content-Length {value[:24]!r} is not a byte count")
    length = int(value)
    if length > maximum:
        raise BadRequest(413, f"a body of {length} bytes, over the {maximum} allowed")
    return length


def byte_range(value: str | None, size: int) -> tuple[int, int]:
    """[start, end) of a file of ``size`` bytes that a Range header asks for (all of it
    without one): 416 for any form but one ``bytes=a-b``, 404 for a range outside it."""
    match = _RANGE.fullmatch(value or f"bytes=0-{size - 1}")
    if match is None:
        raise BadRequest(416, f"Range {(value or '')[:40]!r} is not bytes=<first>-<last>")
    start, end = int(match[1]), int(match[2]) + 1
    if not 0 <= start < end <= size:
        raise BadRequest(404, f"bytes [{start}, {end}) are not within the {size} held")
    return start, end


def send_chunk_range(
    handler: http.server.BaseHTTPRequestHandler,
    f: Any,
    deadline: Deadline,
    send_deadline_s: float,
) -> int | None:
    """Answer a GET for an open chunk file: 206 with the Range asked (the whole file
    without one), its body copied by the kernel from page cache to the socket (no bytes
    through Python, no GIL held), within ``send_deadline_s``. A bad Range is returned, as
    the status for the caller's error reply, and nothing is sent. Entries are never
    rewritten in place: a file that shrank under us gives a short body, and the
    connection is closed so the client sees it."""
    size = os.fstat(f.fileno()).st_size
    try:
        start, end = byte_range(handler.headers.get("Range"), size)
    except BadRequest as exc:
        return exc.status
    deadline.reset(send_deadline_s, "the answer")
    handler.send_response(206)
    handler.send_header("Content-Type", "application/octet-stream")
    handler.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
    handler.send_header("Content-Length", str(end - start))
    handler.end_headers()
    if send_file(handler.connection, f, start, end - start, deadline) != end - start:
        handler.close_connection = True
    return None


def bearer_matches(values: Sequence[str] | None, token: bytes) -> bool:
    """Exactly one ``Authorization: Bearer <token>``, compared in constant time."""
    if not values or len(values) != 1 or not values[0].startswith("Bearer "):
        return False
    return hmac.compare_digest(values[0].removeprefix("Bearer ").encode(), token)


# -- the client's side ------------------------------------------------------------------


class PeerProtocolError(Exception):
    """A peer answered what the protocol does not allow (or not at all)."""


class StaleConnection(PeerProtocolError):
    """The connection closed before any byte of the answer: a kept-alive connection the
    peer had closed meanwhile (worth one retry on a new one), or a peer that hangs up."""


def resolve(host: str, port: int, deadline: Deadline) -> tuple[int, Any]:
    """(family, address) of ``host``; a name lookup (which no socket timeout bounds) runs on
    a thread of its own, and is given up at the deadline."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
        return info[0][0], info[0][4]
    except socket.gaierror:
        pass
    found: list[Any] = []
    done = threading.Event()

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)
        finally:
            done.set()

    threading.Thread(target=lookup, name="ctj-peer-lookup", daemon=True).start()
    if not done.wait(deadline.left()):
        raise TimeoutError(f"looking up {host} took over {deadline.seconds:.1f}s")
    if isinstance(found[0], OSError):
        raise found[0]
    return found[0][0][0], found[0][0][4]


class PeerConnection:
    """One HTTP/1.1 connection to a peer, kept alive across requests; every request
    within its own deadline, no answer's body read past ``max_body``."""

    def __init__(self, sock: socket.socket, deadline: Deadline) -> None:
        self.sock = sock
        self._raw = DeadlineReader(sock, deadline)
        self.reader = io.BufferedReader(self._raw, 64 << 10)
        self.used = time.monotonic()

    @classmethod
    def open(cls, address: tuple[int, Any], deadline: Deadline) -> PeerConnection:
        family, sockaddr = address
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.left())
            sock.connect(sockaddr)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except TimeoutError:
            sock.close()
            raise TimeoutError(f"connecting took over {deadline.seconds:.1f}s") from None
        except BaseException:
            sock.close()
            raise
        return cls(sock, deadline)

    def idle_s(self) -> float:
        return time.monotonic() - self.used

    def close(self) -> None:
        self.sock.close()

    def exchange(
        self, request: bytes, max_body: int, deadline: Deadline
    ) -> tuple[int, bytes, bool]:
        """Send ``request``; (status, body, whether the connection may be reused). An
        answer whose Content-Length is over ``max_body`` (or that has none) is a
        PeerProtocolError before any byte of its body is read."""
        self._raw.deadline = deadline
        try:
            send_all(self.sock, request, deadline)
            line = self.reader.readline(MAX_LINE + 1)
        except (ConnectionResetError, BrokenPipeError) as exc:
            raise StaleConnection(f"closed the connection ({exc.strerror})") from None
        if not line:
            raise StaleConnection("closed the connection without an answer")
        match = _STATUS.fullmatch(line)
        if match is None:
            raise PeerProtocolError(f"answered {line[:40]!r}, not an HTTP/1.1 status line")
        try:
            headers = http.client.parse_headers(self.reader)  # at most 100 lines of 64 KiB
        except http.client.HTTPException as exc:
            raise PeerProtocolError(f"sent bad headers ({type(exc).__name__})") from None
        if headers.get("Transfer-Encoding") is not None:
            raise PeerProtocolError("sent a Transfer-Encoding (only Content-Length is read)")
        if headers.get("Content-Length") is None:
            raise PeerProtocolError("sent no Content-Length (only a bounded answer is read)")
        try:
            length = content_length(headers.get_all("Content-Length"), max_body)
        except BadRequest as exc:
            raise PeerProtocolError(f"answered with {exc}") from None
        body = self.reader.read(length)
        if len(body) != length:
            raise PeerProtocolError(f"closed the connection after {len(body)} of {length} bytes")
        self.used = time.monotonic()
        return int(match[1]), body, (headers.get("Connection") or "").lower() != "close"
