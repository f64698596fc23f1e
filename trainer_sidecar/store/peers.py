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

Neither side trusts the other's timing or sizes (store/peer_limits.py): the server
closes idle, slow and excess connections and answers a bad or unauthenticated request
before reading its body; the client gives each request a wall-clock deadline, reads no
answer longer than it asked for, drops a peer that missed, and stops asking peers once
they have wasted the restore its budget, so that a restore through the peers is never
slower than one from S3 alone by more than ``PeerClientLimits.bound_s``.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import dataclasses
import http.server
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from .chunk_cache import ChunkCache, valid_chunk_id
from .peer_limits import MAX_HAS_IDS, PeerClientLimits, PeerServerLimits, WasteMeter
from .peer_wire import (
    BadRequest,
    Deadline,
    DeadlineWriter,
    PeerConnection,
    PeerProtocolError,
    StaleConnection,
    bearer_matches,
    buffered_reader,
    content_length,
    resolve,
    send_chunk_range,
)

log = logging.getLogger(__name__)

TOKEN_ENV = "CTJ_CACHE_TOKEN"
NODE_PATH = "/v1/node"
"""On a sidecar whose node has an agent: ``{"agent": "host:port"}``, where the peers read."""
__all__ = ["MAX_HAS_IDS", "NODE_PATH", "TOKEN_ENV", "PeerCaches", "own_index", "serve_cache"]


# -- the server (in each sidecar) ------------------------------------------------------


class _CacheHandler(http.server.BaseHTTPRequestHandler):
    """One connection: its requests, each phase within its deadline (peer_limits)."""

    cache: ChunkCache | None
    token: bytes
    limits: PeerServerLimits
    node_agent: str | None = None
    protocol_version = "HTTP/1.1"  # keep-alive: a restore makes many requests
    disable_nagle_algorithm = True

    def setup(self) -> None:
        super().setup()  # sets the socket's timeout: its own reads and writes need one
        self.deadline = Deadline(self.limits.header_deadline_s, "the request's headers")
        self.rfile = buffered_reader(self.connection, self.deadline)
        self.wfile = DeadlineWriter(self.connection, self.deadline)  # type: ignore[assignment]

    def handle_one_request(self) -> None:
        # from the moment the connection is ready for a request: idle keep-alive included
        self.deadline.reset(self.limits.header_deadline_s, "the request's headers")
        super().handle_one_request()  # a TimeoutError in any phase closes the connection

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - stdlib's name
        log.debug("peer cache, client %s: " + format, self.client_address[0], *args)

    def handle_expect_100(self) -> bool:
        """An ``Expect: 100-continue`` is answered as the request would be: never a 100
        that asks an unauthenticated or oversized body to come."""
        if not self._authorized() or self._body_length() is None:
            return False
        return super().handle_expect_100()

    def _authorized(self) -> bool:
        if bearer_matches(self.headers.get_all("Authorization"), self.token):
            return True
        self._reply(401, b"")  # at once: the body, if any, is never read
        return False

    def _body_length(self, maximum: int | None = None) -> int | None:
        """The request body's length, checked; None once a 400/413 is answered."""
        try:
            if self.headers.get("Transfer-Encoding") is not None:
                raise BadRequest(400, "a Transfer-Encoding (only Content-Length is read)")
            limit = self.limits.max_body_bytes if maximum is None else maximum
            return content_length(self.headers.get_all("Content-Length"), limit)
        except BadRequest as exc:
            log.debug("peer cache, client %s: %s", self.client_address[0], exc)
            self._reply(exc.status, b"")
            return None

    def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
        self.deadline.reset(self.limits.send_deadline_s, "the answer")
        self.send_response(status)
        if status >= 400:  # a request body may be left unread: this connection ends here
            self.send_header("Connection", "close")
            self.close_connection = True
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorized():
            return
        if self.path != "/v1/has" or self.cache is None:
            self._reply(404, b"")
            return
        length = self._body_length()
        if length is None:
            return
        self.deadline.reset(self.limits.body_deadline_s, "the request's body")
        body = self.rfile.read(length)
        if len(body) != length:  # it hung up
            self.close_connection = True
            return
        try:
            ids = json.loads(body)["ids"]
            if not isinstance(ids, list):
                raise TypeError("ids")
            held = sorted(self.cache.held(i for i in ids if isinstance(i, str)))
        except (ValueError, KeyError, TypeError):
            self._reply(400, b"")
            return
        self._reply(200, json.dumps({"ids": held}).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        if not self._authorized() or self._body_length(maximum=0) is None:
            return  # a GET with a body: 413, and the connection closed
        if self.path == NODE_PATH and self.node_agent is not None:
            body = json.dumps({"agent": self.node_agent}).encode()
            self._reply(200, body, "application/json")
            return
        chunk_id = self.path.removeprefix("/v1/chunks/")
        usable = self.cache is not None and valid_chunk_id(chunk_id)
        f = self.cache.open(chunk_id) if usable and self.cache is not None else None
        if f is None:
            self._reply(404, b"")
            return
        with f:
            bad = send_chunk_range(self, f, self.deadline, self.limits.send_deadline_s)
        if bad is not None:
            self._reply(bad, b"")


_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"


class PeerCacheServer(http.server.ThreadingHTTPServer):
    """The threading HTTP server with a bound on its connections (and so its threads):
    one past ``limits.max_connections`` is answered 503 and closed on the accepting
    thread, without a thread or a read of its own."""

    daemon_threads = True
    block_on_close = False  # shutdown never waits on a client: its deadline ends it
    request_queue_size = 128

    def __init__(
        self, address: tuple[str, int], handler: type[_CacheHandler], limits: PeerServerLimits
    ) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._open = 0
        self._refused = 0
        self._refused_logged = 0.0
        super().__init__(address, handler)

    @property
    def open_connections(self) -> int:
        return self._open

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._lock:
            full = self._open >= self.limits.max_connections
            if not full:
                self._open += 1
        if full:
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread: nobody else will count it closed
            self._closed()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._closed()

    def _closed(self) -> None:
        with self._lock:
            self._open -= 1

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        with contextlib.suppress(OSError):
            request.setblocking(False)
            request.send(_BUSY)  # a fresh socket's buffer takes it: never blocks
        self.shutdown_request(request)
        self._refused += 1
        now = time.monotonic()
        if now - self._refused_logged >= 10.0:  # one line per 10 s, however many come
            log.warning(
                "peer cache: refused %d connection(s), the latest from %s: %d are open "
                "(max_connections; CTJ_PEER_MAX_CONNECTIONS)",
                self._refused, client_address[0], self.limits.max_connections,
            )  # fmt: skip
            self._refused, self._refused_logged = 0, now

    def handle_error(self, request: Any, client_address: Any) -> None:
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):  # a client that went away, or took too long
            log.debug("peer cache, client %s: %s", client_address[0], exc)
        else:
            log.warning("peer cache, client %s: %r", client_address[0], exc, exc_info=True)


def serve_cache(
    cache: ChunkCache | None,
    *,
    token: str,
    host: str = "0.0.0.0",
    port: int = 0,
    limits: PeerServerLimits | None = None,
    node_agent: str | None = None,
) -> PeerCacheServer:
    """Serve ``cache`` to the job's peers on a thread; port 0 picks a free one. ``limits``:
    the deadlines and the connection bound (default: from CTJ_PEER_*, peer_limits.py).
    ``node_agent`` (``host:port``): where a node agent holds this node's cache instead
    (``cache`` None); the server then only says so (``GET /v1/node``), and the peers read
    from that agent. Stop it with ``server.shutdown(); server.server_close()``."""
    if len(token) < 16:
        raise ValueError(f"{TOKEN_ENV} must be a random secret of at least 16 characters")
    limits = PeerServerLimits.from_env() if limits is None else limits
    handler = type(
        "Handler",
        (_CacheHandler,),
        # timeout: StreamRequestHandler sets it on the socket before the first read
        {"cache": cache, "token": token.encode(), "limits": limits, "node_agent": node_agent,
         "timeout": limits.header_deadline_s},
    )  # fmt: skip
    server = PeerCacheServer((host, port), handler, limits)
    threading.Thread(target=server.serve_forever, name="ctj-peer-cache", daemon=True).start()
    return server


# -- the client (in a restoring rank) --------------------------------------------------


def own_index(peers: Sequence[str], hostname: str | None = None) -> int | None:
    """Which entry of the pods' list (``host:port``, host ``<pod>`` or ``<pod>.<service>``)
    is this pod (its hostname is its pod name), or None."""
    own = socket.gethostname() if hostname is None else hostname
    found = [i for i, p in enumerate(peers) if p.rsplit(":", 1)[0].split(".")[0] == own]
    return found[0] if found else None


class Requester:
    """HTTP/1.1 requests to ``host:port`` servers of the peer protocol (a peer's sidecar,
    a node agent), each within a wall-clock deadline, on kept-alive connections per
    thread; every request carries the job's token. Neither the request (which holds the
    token) nor its answer is ever logged."""

    def __init__(self, token: str, limits: PeerClientLimits) -> None:
        self.token, self.limits = token, limits
        self._addresses: dict[str, tuple[int, Any]] = {}
        self._local = threading.local()

    def _address(self, peer: str, deadline: Deadline) -> tuple[int, Any]:
        address = self._addresses.get(peer)
        if address is None:
            host, port = split_address(peer)
            address = self._addresses[peer] = resolve(host, port, deadline)
        return address

    def request(
        self, peer: str, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | memoryview | None = None, *, max_body: int, seconds: float,
        reuse: bool = True, content_type: str = "application/json",
    ) -> tuple[int, bytes]:  # fmt: skip
        """One request to ``peer`` within ``seconds`` of wall clock, on this thread's
        kept-alive connection to it (``reuse``) if it was used within ``keepalive_s``."""
        deadline = Deadline(seconds, f"{method} {path[:28]}")
        fields = {"Host": peer, "Authorization": f"Bearer {self.token}", **(headers or {})}
        if body is not None:
            fields |= {"Content-Type": content_type, "Content-Length": str(len(body))}
        head = "".join(f"{k}: {v}\r\n" for k, v in fields.items())
        request = f"{method} {path} HTTP/1.1\r\n{head}\r\n".encode() + bytes(body or b"")
        conns: dict[str, PeerConnection] = self._local.__dict__.setdefault("c", {})
        for _ in range(2):
            conn = conns.pop(peer, None) if reuse else None
            if conn is not None and conn.idle_s() > self.limits.keepalive_s:
                conn.close()  # the server may be closing it right now
                conn = None
            fresh = conn is None
            if conn is None:
                conn = PeerConnection.open(self._address(peer, deadline), deadline)
            try:
                status, data, keep = conn.exchange(request, max_body, deadline)
            except StaleConnection:
                conn.close()
                if fresh:
                    raise
                continue  # a kept-alive connection the server had closed: once more, fresh
            except BaseException:
                conn.close()
                raise
            if keep and reuse:
                conns[peer] = conn
            else:
                conn.close()
            return status, data
        raise AssertionError("unreachable")


def split_address(peer: str) -> tuple[str, int]:
    """``host:port`` (an IPv6 host in brackets, or bare: the port is after the last
    colon) as (host, port); ValueError otherwise."""
    host, sep, port = peer.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{peer!r} is not host:port")
    return host, int(port)


class PeerCaches:
    """The job's other pods' caches, as one restore (or one replication round) reads them.

    Every request has a wall-clock deadline; a peer that misses for any reason but "not
    held" is not asked again; once the peers have wasted ``limits.restore_budget_s`` of
    wall clock, none is asked again (peer_limits.py). Make a fresh one per restore
    (``renewed``)."""

    def __init__(
        self,
        peers: Sequence[str],
        *,
        token: str,
        limits: PeerClientLimits | None = None,
        job_path: str | None = None,
    ) -> None:
        """``peers``: every pod's cache server; this pod's own entry is left out.
        ``limits``: default from CTJ_PEER_* (peer_limits.py). ``job_path`` (the job's
        path on a node agent, store/agent_client.job_path): the peers' nodes have agents;
        each peer is asked once where its node's agent is (``GET /v1/node``) and the chunks
        are read from that agent, directly."""
        own = own_index(peers)
        self.peers = [p for i, p in enumerate(peers) if p and i != own]
        self.limits = PeerClientLimits.from_env() if limits is None else limits
        self._token = token
        self._job_path = job_path
        self._agents: dict[str, str] = {}  # peer -> its node agent's host:port
        self._http = Requester(token, self.limits)
        self._held: dict[str, list[str]] = {}  # chunk id -> peers that said they hold it
        self._served_by: dict[str, str] = {}  # chunk id -> the peer its last bytes came from
        self._down: set[str] = set()
        self._waste = WasteMeter()
        self._out_of_budget = False
        self._lock = threading.Lock()

    def renewed(self, **limits: float) -> PeerCaches:
        """The same peers, token and limits (but those given), nothing remembered: for the
        next restore."""
        new_limits = dataclasses.replace(self.limits, **limits)
        return PeerCaches(self.peers, token=self._token, limits=new_limits, job_path=self._job_path)

    @property
    def wasted_s(self) -> float:
        """Wall-clock seconds the peers have wasted so far (peer_limits.WasteMeter)."""
        with self._lock:
            return self._waste.spent

    def locate(self, chunk_ids: Iterable[str]) -> None:
        """Ask every peer, in parallel, which of these chunks it holds."""
        wanted = sorted({c for c in chunk_ids if c not in self._held})
        peers = [p for p in self.peers if p not in self._down]
        if not wanted or not peers or self._spent():
            return
        body = json.dumps({"ids": wanted}).encode()
        began = time.monotonic()
        with cf.ThreadPoolExecutor(min(len(peers), 16), thread_name_prefix="ctj-peer") as ex:
            answers = list(ex.map(lambda p: (p, self._has(p, body, set(wanted))), peers))
        with self._lock:
            self._waste.charge(began, time.monotonic())  # none of it is a restore's work
            for peer, held in answers:
                for chunk_id in held:
                    self._held.setdefault(chunk_id, []).append(peer)

    def _has(self, peer: str, body: bytes, wanted: set[str]) -> list[str]:
        try:
            if self._job_path is not None and peer not in self._agents:
                self._agents[peer] = self._find_agent(peer)
            status, data = self._request(
                peer, "POST", "/v1/has", body=body,
                max_body=len(body) + 1024,  # the ids held: some of those asked
                seconds=self.limits.locate_deadline_s, reuse=False,
            )  # fmt: skip
            if status != 200:
                raise PeerProtocolError(f"answered HTTP {status} to a has-query")
            return [i for i in json.loads(data)["ids"] if isinstance(i, str) and i in wanted]
        except (OSError, ValueError, KeyError, TypeError, PeerProtocolError) as exc:
            self._mark_down(peer, _why(exc))
            return []

    def _find_agent(self, peer: str) -> str:
        """The node agent of ``peer``'s node, as its sidecar names it (``GET /v1/node``)."""
        status, data = self._http.request(
            peer, "GET", NODE_PATH, max_body=1024, seconds=self.limits.locate_deadline_s,
            reuse=False,
        )  # fmt: skip
        if status != 200:
            raise PeerProtocolError(f"answered HTTP {status} to where its node agent is")
        agent = json.loads(data)["agent"]
        if not isinstance(agent, str):
            raise PeerProtocolError("named no node agent")
        split_address(agent)  # ValueError unless host:port
        return agent

    def _request(
        self, peer: str, method: str, path: str, headers: dict[str, str] | None = None,
        body: bytes | None = None, *, max_body: int, seconds: float, reuse: bool = True,
    ) -> tuple[int, bytes]:  # fmt: skip
        """A request of the peer protocol to ``peer``: to its node's agent, under the
        job's path, where the nodes have agents."""
        if self._job_path is not None:
            peer, path = self._agents[peer], self._job_path + path.removeprefix("/v1")
        return self._http.request(
            peer, method, path, headers, body, max_body=max_body, seconds=seconds, reuse=reuse
        )

    def read(self, chunk_id: str, start: int, end: int) -> bytes | None:
        """Bytes [start, end) of the chunk from a peer that holds it, or None: within
        ``limits.deadline_s(end - start)`` per peer asked, no peer asked once they have
        wasted the restore's budget."""
        size = end - start
        if size <= 0:
            return None
        for peer in self._held.get(chunk_id, []):
            if peer in self._down:
                continue
            if self._spent():
                return None
            headers = {"Range": f"bytes={start}-{end - 1}"}
            began = time.monotonic()
            try:
                status, data = self._request(
                    peer, "GET", f"/v1/chunks/{chunk_id}", headers,
                    max_body=size, seconds=self.limits.deadline_s(size),
                )  # fmt: skip
            except (OSError, ValueError, PeerProtocolError) as exc:
                self._missed(peer, began, _why(exc))
                continue
            if status == 206 and len(data) == size:
                with self._lock:  # a slow hit wastes what it took past a fast store's time
                    self._waste.charge(began + self.limits.fair_s(size), time.monotonic())
                    self._served_by[chunk_id] = peer
                return data
            if status == 404:  # evicted since it said it held it: a miss, the peer is fine
                with self._lock:
                    self._waste.charge(began, time.monotonic())
                continue
            self._missed(peer, began, f"answered HTTP {status} with {len(data)} of {size} bytes")
        return None

    def reject(self, chunk_id: str) -> None:
        """Forget who holds a chunk whose bytes failed their check; the peer that sent
        them is not asked again."""
        with self._lock:
            self._held.pop(chunk_id, None)
            peer = self._served_by.pop(chunk_id, None)
        if peer is not None:
            self._mark_down(peer, f"sent bytes of chunk {chunk_id[:16]} that fail their check")

    def _spent(self) -> bool:
        """Whether the peers have wasted this restore's budget (said once)."""
        with self._lock:
            spent = self._waste.spent
            if spent < self.limits.restore_budget_s:
                return False
            first, self._out_of_budget = not self._out_of_budget, True
        if first:
            log.warning(
                "peer caches wasted %.1fs of this restore (budget %.1fs, "
                "CTJ_PEER_RESTORE_BUDGET_S): reading the rest without them",
                spent, self.limits.restore_budget_s,
            )  # fmt: skip
        return True

    def _missed(self, peer: str, began: float, why: str) -> None:
        with self._lock:
            self._waste.charge(began, time.monotonic())
        self._mark_down(peer, why)

    def _mark_down(self, peer: str, why: str) -> None:
        with self._lock:
            new = peer not in self._down
            self._down.add(peer)
        if new:
            log.warning("peer cache %s %s: reading around it in this restore", peer, why)


def _why(exc: BaseException) -> str:
    """What went wrong with a peer, in words (never the request, which holds the token)."""
    if isinstance(exc, TimeoutError):
        return f"timed out ({exc})"
    if isinstance(exc, PeerProtocolError):
        return str(exc)
    if isinstance(exc, OSError):
        return f"failed ({exc.strerror or type(exc).__name__})"
    return f"answered nonsense ({type(exc).__name__})"
