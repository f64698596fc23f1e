"""Peers' node caches: each sidecar serves its node's chunk cache to the job's other pods.

A rank restarted on a new node has an empty cache, but the job's other nodes
hold the chunks their ranks saved. Each sidecar serves its cache over HTTP;
a restoring rank asks every peer once which of the chunks it needs it holds,
then reads each from one that does, before falling back to S3.

    POST /v1/has          {"ids": [...]}  ->  {"ids": [the ones held]}
    GET  /v1/chunks/<id>  Range: bytes=a-b   ->  206, the raw bytes [a, b]

Every request carries ``Authorization: Bearer <token>``: a random secret the
operator makes per job and hands only to that job's pods (a Secret). Without a
token there is no server: a cache is never served unauthenticated. The server
only ever opens ``<cache>/<id[:2]>/<id>`` for an id of 64 hex digits. What a
peer returns is not trusted either: the reader checks every block against the
manifest, and a peer that fails, refuses or returns bad bytes is just a miss.
"""

from __future__ import annotations

import concurrent.futures as cf
import hmac
import http.client
import http.server
import json
import logging
import os
import re
import socket
import threading
import urllib.parse
from collections.abc import Iterable, Sequence

from .chunk_cache import ChunkCache, valid_chunk_id

log = logging.getLogger(__name__)

TOKEN_ENV = "CTJ_CACHE_TOKEN"
MAX_HAS_IDS = 100_000  # a has-query body is at most ~7 MB
_RANGE = re.compile(r"bytes=(\d+)-(\d+)")


# -- the server (in each sidecar) ------------------------------------------------------


class _CacheHandler(http.server.BaseHTTPRequestHandler):
    cache: ChunkCache
    token: bytes
    protocol_version = "HTTP/1.1"  # keep-alive: a restore makes many requests

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        log.debug("peer cache: " + format, *args)

    def _authorized(self) -> bool:
        given = (self.headers.get("Authorization") or "").removeprefix("Bearer ").encode()
        if hmac.compare_digest(given, self.token):
            return True
        self._reply(401, b"")
        return False

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.send_response(status)
        if status >= 400:  # a request body may be left unread: this connection ends here
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        length = int(self.headers.get("Content-Length") or 0)
        if not self._authorized():
            return
        if self.path != "/v1/has" or length > MAX_HAS_IDS * 70:
            self._reply(404 if self.path != "/v1/has" else 413, b"")
            return
        try:
            ids = json.loads(self.rfile.read(length))["ids"]
            held = [i for i in ids if isinstance(i, str) and self.cache.size_of(i) is not None]
        except (ValueError, KeyError, TypeError):
            self._reply(400, b"")
            return
        self._reply(200, json.dumps({"ids": held}).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        chunk_id = self.path.removeprefix("/v1/chunks/")
        f = self.cache.open(chunk_id) if valid_chunk_id(chunk_id) else None
        if f is None:
            self._reply(404, b"")
            return
        with f:
            size = os.fstat(f.fileno()).st_size  # entries are never rewritten in place
            match = _RANGE.fullmatch(self.headers.get("Range") or f"bytes=0-{size - 1}")
            start, end = (int(match[1]), int(match[2]) + 1) if match else (0, -1)
            if not 0 <= start < end <= size:
                self._reply(404 if match else 416, b"")
                return
            self.send_response(206)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            # the kernel copies page cache to socket: no bytes through Python, no GIL held
            sent = self.connection.sendfile(f, start, end - start)
        if sent != end - start:  # the file shrank under us: the client sees a short body
            self.close_connection = True


def serve_cache(
    cache: ChunkCache, *, token: str, host: str = "0.0.0.0", port: int = 0
) -> http.server.ThreadingHTTPServer:
    """Serve ``cache`` to the job's peers on a thread; port 0 picks a free one.
    Stop it with ``server.shutdown(); server.server_close()``."""
    if len(token) < 16:
        raise ValueError(f"{TOKEN_ENV} must be a random secret of at least 16 characters")
    handler = type("Handler", (_CacheHandler,), {"cache": cache, "token": token.encode()})
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="ctj-peer-cache", daemon=True).start()
    return server


# -- the client (in a restoring rank) --------------------------------------------------


def own_index(peers: Sequence[str], hostname: str | None = None) -> int | None:
    """Which entry of the pods' list (``host:port``, host ``<pod>`` or ``<pod>.<service>``)
    is this pod (its hostname is its pod name), or None."""
    own = socket.gethostname() if hostname is None else hostname
    found = [i for i, p in enumerate(peers) if p.rsplit(":", 1)[0].split(".")[0] == own]
    return found[0] if found else None


class PeerCaches:
    """The job's other pods' caches, as a restoring rank reads them."""

    def __init__(self, peers: Sequence[str], *, token: str, timeout_s: float = 10.0) -> None:
        """``peers``: every pod's cache server; this pod's own entry is left out."""
        own = own_index(peers)
        self.peers = [p for i, p in enumerate(peers) if p and i != own]
        self._auth = {"Authorization": f"Bearer {token}"}
        self._timeout = timeout_s
        self._held: dict[str, list[str]] = {}  # chunk id -> peers that said they hold it
        self._down: set[str] = set()
        self._lock = threading.Lock()
        self._local = threading.local()

    def locate(self, chunk_ids: Iterable[str]) -> None:
        """Ask every peer, in parallel, which of these chunks it holds."""
        wanted = sorted({c for c in chunk_ids if c not in self._held})
        if not wanted or not self.peers:
            return
        body = json.dumps({"ids": wanted}).encode()
        with cf.ThreadPoolExecutor(min(len(self.peers), 16), thread_name_prefix="ctj-peer") as ex:
            answers = list(ex.map(lambda p: (p, self._has(p, body)), self.peers))
        with self._lock:
            for peer, held in answers:
                for chunk_id in held:
                    self._held.setdefault(chunk_id, []).append(peer)

    def _has(self, peer: str, body: bytes) -> list[str]:
        try:
            status, data = self._request(peer, "POST", "/v1/has", body=body)
            if status != 200:
                raise OSError(f"HTTP {status}")
            return [str(i) for i in json.loads(data)["ids"]]
        except (OSError, ValueError, KeyError, http.client.HTTPException) as exc:
            self._mark_down(peer, exc)
            return []

    def read(self, chunk_id: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the chunk from a peer that holds it, or None."""
        for peer in self._held.get(chunk_id, []):
            if peer in self._down:
                continue
            headers = {"Range": f"bytes={start}-{end - 1}"}
            try:
                status, data = self._request(peer, "GET", f"/v1/chunks/{chunk_id}", headers)
            except (OSError, http.client.HTTPException) as exc:
                self._mark_down(peer, exc)
                continue
            if status == 206 and len(data) == end - start:
                return data
        return None

    def reject(self, chunk_id: str) -> None:
        """Forget who holds a chunk whose bytes failed their check."""
        with self._lock:
            self._held.pop(chunk_id, None)

    def _mark_down(self, peer: str, exc: BaseException) -> None:
        with self._lock:
            new = peer not in self._down
            self._down.add(peer)
        if new:
            why = getattr(exc, "strerror", None) or str(exc) or type(exc).__name__
            log.warning("peer cache %s unavailable (%s): reading around it", peer, why)

    def _request(
        self, peer: str, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | None = None,
    ) -> tuple[int, bytes]:  # fmt: skip
        """One request on this thread's keep-alive connection to ``peer``."""
        conns: dict[str, http.client.HTTPConnection] = self._local.__dict__.setdefault("c", {})
        for retry in (False, True):
            conn = conns.get(peer)
            if conn is None:
                url = urllib.parse.urlsplit(f"http://{peer}")
                host, port = url.hostname or "", url.port
                conn = http.client.HTTPConnection(host, port, timeout=self._timeout)
                conns[peer] = conn
            try:
                conn.request(method, path, body=body, headers={**self._auth, **(headers or {})})
                resp = conn.getresponse()
                return resp.status, resp.read()
            except (ConnectionResetError, BrokenPipeError, http.client.RemoteDisconnected):
                conn.close()
                conns.pop(peer, None)
                if retry:  # a kept-alive connection the server had closed: once more, fresh
                    raise
        raise AssertionError("unreachable")
