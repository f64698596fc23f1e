"""A fault-injecting HTTP/1.1 proxy on loopback, in front of the test S3 server.

Requests are forwarded byte for byte (body and signing headers intact), one
upstream connection per request: moto closes the connection after every reply,
and a reply that says ``Connection: close`` closes the client's connection too.
What it can do wrong, chosen per request by a seeded random draw
(``fault_rate``; among the faults that fit a request, one injected least so
far, so that faults few requests fit still show up early) or queued for the
next requests it applies to (``inject_next``):

- ``slowdown``: 503 SlowDown with S3's XML error body, nothing forwarded;
- ``internal_error``: 500 InternalError, nothing forwarded;
- ``reset_before_reply``: read the whole request, then a TCP reset, nothing forwarded;
- ``reset_mid_body``: read half the request body, then a reset (requests with a body);
- ``short_body``: forward a GET, send the reply's headers (its full Content-Length)
  and half the body, then close;
- ``conflict``: 409 ConditionalRequestConflict to a PUT with If-None-Match
  (S3's answer when two conditional writes race), nothing forwarded;
- ``lost_reply``: forward, let the server act, then reset instead of replying;
- ``access_denied``: 403 AccessDenied, nothing forwarded (a failure that is not the
  server's being away: never retried).

``outage(method, marker, seconds)`` is the server gone for a while (its pod deleted and
started again): from the first request with that method whose request line contains
``marker``, every request that arrives within ``seconds`` is answered with a TCP reset,
that one included (counted as ``outage``).

``hold(method, marker)`` holds requests instead (a request slow to arrive): each one
with that method whose request line contains ``marker`` is read whole, then forwarded
only once ``release()`` is called; ``holding`` is set when the first one is held.

The first five are ``DEFAULT_FAULTS``; ``ALL_FAULTS`` are those a client rides out, the
ones before ``access_denied``. ``drop_if_none_match=True`` strips the
If-None-Match header: a server that ignores conditional writes (moto does not
check signatures, so the signed header's absence goes unnoticed).
``injected`` counts what was done, ``requests`` what arrived.
"""

from __future__ import annotations

import collections
import random
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO
from urllib.parse import urlsplit

DEFAULT_FAULTS = (
    "slowdown",
    "internal_error",
    "reset_before_reply",
    "reset_mid_body",
    "short_body",
)
ALL_FAULTS = (*DEFAULT_FAULTS, "conflict", "lost_reply")  # every one a client rides out
REFUSALS = ("access_denied",)  # injected only when asked for (inject_next)
_ERRORS = {
    "slowdown": (503, "Slow Down", "SlowDown", "Please reduce your request rate."),
    "internal_error": (500, "Internal Server Error", "InternalError", "We encountered an error."),
    "access_denied": (403, "Forbidden", "AccessDenied", "Access Denied"),
    "conflict": (
        409,
        "Conflict",
        "ConditionalRequestConflict",
        "A conflicting conditional operation is currently in progress against this resource.",
    ),
}


class _Request:
    def __init__(self, head: list[bytes], body: bytes | None, body_length: int) -> None:
        self.head = head  # request line and header lines, without CRLFs
        self.body = body  # None until read
        self.body_length = body_length  # from Content-Length; -1 when chunked
        self.method = head[0].split(b" ", 1)[0].decode()

    def header(self, name: str) -> str | None:
        for line in self.head[1:]:
            k, _, v = line.partition(b":")
            if k.strip().lower() == name.encode():
                return v.strip().decode()
        return None


def _read_head(f: BinaryIO) -> list[bytes] | None:
    lines: list[bytes] = []
    while True:
        line = f.readline(65536)
        if not line:
            return None  # the peer closed
        line = line.rstrip(b"\r\n")
        if not line:
            if lines:
                return lines
            continue  # stray CRLF between messages
        lines.append(line)


def _read_chunked(f: BinaryIO) -> bytes:
    raw = b""
    while True:
        size_line = f.readline(65536)
        raw += size_line
        size = int(size_line.split(b";", 1)[0].strip(), 16)
        if size == 0:
            while True:  # trailers, up to the empty line
                line = f.readline(65536)
                raw += line
                if line in (b"\r\n", b"\n", b""):
                    return raw
        raw += f.read(size + 2)


def _content_length(head: list[bytes]) -> int | None:
    for line in head[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v.strip())
    return None


def _is_chunked(head: list[bytes]) -> bool:
    return any(
        k.strip().lower() == b"transfer-encoding" and b"chunked" in v.lower()
        for k, _, v in (line.partition(b":") for line in head[1:])
    )


def _wants_close(head: list[bytes]) -> bool:
    return head[0].startswith(b"HTTP/1.0") or any(
        k.strip().lower() == b"connection" and v.strip().lower() == b"close"
        for k, _, v in (line.partition(b":") for line in head[1:])
    )


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a crashed server or a middlebox would."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class FaultProxy:
    def __init__(
        self,
        upstream: str,
        *,
        drop_if_none_match: bool = False,
        fault_rate: float = 0.0,
        faults: Sequence[str] = DEFAULT_FAULTS,
        seed: int = 0,
    ) -> None:
        unknown = set(faults) - {*ALL_FAULTS, *REFUSALS}
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}: choose from {ALL_FAULTS}")
        parts = urlsplit(upstream)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.drop_if_none_match = drop_if_none_match
        self.fault_rate = fault_rate
        self.faults = tuple(faults)
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._queued: list[str] = []
        self._injected: collections.Counter[str] = collections.Counter()
        self._requests = 0
        self._hold: tuple[str, bytes] | None = None
        self._outage: tuple[str, bytes, float] | None = None
        self._outage_ends: float | None = None  # monotonic, once the outage began
        self.holding = threading.Event()
        self._released = threading.Event()
        proxy = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                proxy._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def injected(self) -> dict[str, int]:
        with self._lock:
            return dict(self._injected)

    @property
    def requests(self) -> int:
        with self._lock:
            return self._requests

    def inject_next(self, *faults: str) -> None:
        """Queue faults, each for the next request it applies to (before any random draw)."""
        unknown = set(faults) - {*ALL_FAULTS, *REFUSALS}
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        with self._lock:
            self._queued.extend(faults)

    def outage(self, method: str, marker: str, seconds: float) -> None:
        """Reset every request for ``seconds`` from the first one with ``method`` whose
        request line contains ``marker``."""
        self._outage = (method, marker.encode(), seconds)

    def _in_outage(self, req: _Request) -> bool:
        with self._lock:
            if self._outage_ends is None and self._outage is not None:
                method, marker, seconds = self._outage
                if req.method == method and marker in req.head[0]:
                    self._outage_ends = time.monotonic() + seconds
            return self._outage_ends is not None and time.monotonic() < self._outage_ends

    def hold(self, method: str, marker: str) -> None:
        """Hold every request with ``method`` whose request line contains ``marker``."""
        self._hold = (method, marker.encode())

    def release(self) -> None:
        """Forward what is held, and everything after it, at once."""
        self._released.set()

    def _held(self, req: _Request) -> None:
        if self._hold is None or self._released.is_set():
            return
        method, marker = self._hold
        if req.method == method and marker in req.head[0]:
            self.holding.set()
            if not self._released.wait(120):
                raise TimeoutError("a held request was never released")

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._released.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    # -- per connection ------------------------------------------------------------

    @staticmethod
    def _applies(fault: str, req: _Request) -> bool:
        if fault == "reset_mid_body":
            return req.body_length >= 2
        if fault == "short_body":
            return req.method == "GET"
        if fault == "conflict":
            return req.method == "PUT" and req.header("if-none-match") is not None
        return True

    def _choose(self, req: _Request) -> str | None:
        with self._lock:
            self._requests += 1
            for i, fault in enumerate(self._queued):
                if self._applies(fault, req):
                    return self._queued.pop(i)
            if self.fault_rate and self._rng.random() < self.fault_rate:
                fitting = [f for f in self.faults if self._applies(f, req)]
                if not fitting:
                    return None
                fewest = min(self._injected[f] for f in fitting)  # rare fits catch up
                return self._rng.choice([f for f in fitting if self._injected[f] == fewest])
            return None

    def _count(self, fault: str) -> None:
        with self._lock:
            self._injected[fault] += 1

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(30)
        f = client.makefile("rb")
        try:
            while self._serve_one(client, f):
                pass
        except OSError:
            pass  # the client went away; it retries on a new connection
        finally:
            f.close()
            client.close()

    def _serve_one(self, client: socket.socket, f: BinaryIO) -> bool:
        """One request; whether the client connection stays open for another."""
        head = _read_head(f)
        if head is None:
            return False
        chunked = _is_chunked(head)
        req = _Request(head, None, -1 if chunked else (_content_length(head) or 0))
        if (req.header("expect") or "").lower() == "100-continue":
            client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self._in_outage(req):
            self._count("outage")
            _reset(client)
            return False
        fault = self._choose(req)
        if fault == "reset_mid_body":
            f.read(req.body_length // 2)
            self._count(fault)
            _reset(client)
            return False
        req.body = _read_chunked(f) if chunked else f.read(req.body_length)
        self._held(req)
        if fault == "reset_before_reply":
            self._count(fault)
            _reset(client)
            return False
        if fault in _ERRORS:
            self._count(fault)
            client.sendall(self._error_reply(fault, req))
            return not _wants_close(head)
        reply_head, reply_body = self._forward(req)
        if fault == "lost_reply":
            self._count(fault)
            _reset(client)
            return False
        raw_head = b"\r\n".join(reply_head) + b"\r\n\r\n"
        if fault == "short_body" and reply_head[0].split(b" ")[1] in (b"200", b"206"):
            if len(reply_body) >= 2:
                self._count(fault)
                client.sendall(raw_head + reply_body[: len(reply_body) // 2])
                return False  # closed early: the client is owed the rest
        client.sendall(raw_head + reply_body)
        return not (_wants_close(head) or _wants_close(reply_head))

    def _forward(self, req: _Request) -> tuple[list[bytes], bytes]:
        head = req.head
        if self.drop_if_none_match:
            head = [head[0], *(h for h in head[1:] if not h.lower().startswith(b"if-none-match:"))]
        with socket.create_connection(self.upstream, timeout=30) as up:
            up.sendall(b"\r\n".join(head) + b"\r\n\r\n" + (req.body or b""))
            uf = up.makefile("rb")
            while True:
                reply = _read_head(uf)
                if reply is None:
                    raise ConnectionError("the upstream S3 server closed without a reply")
                if not reply[0].split(b" ")[1].startswith(b"1"):
                    break  # skip 100 Continue: the client had ours
            status = int(reply[0].split(b" ")[1])
            length = _content_length(reply)
            if req.method == "HEAD" or status in (204, 304):
                body = b""
            elif _is_chunked(reply):
                body = _read_chunked(uf)
            elif length is not None:
                body = uf.read(length)
            else:
                body = uf.read()
            uf.close()
        return reply, body

    @staticmethod
    def _error_reply(fault: str, req: _Request) -> bytes:
        status, reason, code, message = _ERRORS[fault]
        xml = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>ctj-fault-proxy</RequestId></Error>"
        ).encode()
        body = b"" if req.method == "HEAD" else xml
        head = (
            f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        return head + body
