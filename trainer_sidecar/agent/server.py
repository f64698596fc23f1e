"""The node agent's HTTP server: every job's chunks on this node, each job's to its own pods.

The protocol is the peer protocol (store/peers.py) under a job's path, plus writes
(store/agent_client.py lists it). A request names its job in the path and carries that
job's token; the agent recomputes the token from the cluster key (ctj_contract.tokens)
and compares in constant time, so it authenticates every job without reading any Secret
or knowing which jobs exist. A wrong token, a malformed path or a bad chunk id is
answered at once, before any body is read.

The peer server's limits hold here too (store/peer_limits.py: deadlines on every phase
of a connection, a bound on connections, no body longer than its kind allows): a chunk
body (at most 64 MiB) is streamed to disk in 1 MiB pieces within ``send_deadline_s``,
so no client can exhaust the agent's memory or hold a thread past its deadlines.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from ctj_contract.tokens import job_token, tokens_match

from ..store.agent_client import JOB_PATH, MAX_CHUNK_BYTES
from ..store.chunk_cache import valid_chunk_id
from ..store.peer_limits import PeerServerLimits
from ..store.peer_wire import send_chunk_range
from ..store.peers import PeerCacheServer, _CacheHandler
from .store import JobKey, NodeStore

log = logging.getLogger(__name__)

PIECE = 1 << 20


class _AgentHandler(_CacheHandler):
    store: NodeStore
    key: bytes

    def _route(self) -> tuple[JobKey, str] | None:
        """(the job, what is asked of it: "/has", "/chunks/<id>", ...) from the path."""
        match = JOB_PATH.match(self.path)
        if match is None or ".." in match["name"]:
            return None
        return JobKey(match["ns"], match["name"], match["uid"]), self.path[match.end() :]

    def _authorized(self) -> bool:
        route = self._route()
        if route is None:
            self._reply(404, b"")
            return False
        job = route[0]
        given = self.headers.get_all("Authorization") or []
        token = given[0].removeprefix("Bearer ") if len(given) == 1 else ""
        expected = job_token(self.key, job.namespace, job.name, job.uid)
        if given and given[0].startswith("Bearer ") and tokens_match(expected, token):
            return True
        self._reply(401, b"")  # at once: the body, if any, is never read
        return False

    def handle_expect_100(self) -> bool:
        if not self._authorized():
            return False
        limit = MAX_CHUNK_BYTES if self.command == "PUT" else None
        if self._body_length(limit) is None:
            return False
        return super(_CacheHandler, self).handle_expect_100()

    def _chunk(self, action: str) -> str | None:
        chunk_id = action.removeprefix("/chunks/")
        if action.startswith("/chunks/") and valid_chunk_id(chunk_id):
            return chunk_id
        self._reply(404, b"")
        return None

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorized():
            return
        job, action = self._route()  # type: ignore[misc]
        if action not in ("/has", "/touch"):
            self._reply(404, b"")
            return
        length = self._body_length()
        if length is None:
            return
        self.deadline.reset(self.limits.body_deadline_s, "the request's body")
        body = self.rfile.read(length)
        if len(body) != length:
            self.close_connection = True
            return
        try:
            ids = json.loads(body)["ids"]
            if not isinstance(ids, list):
                raise TypeError("ids")
            wanted = [i for i in ids if isinstance(i, str) and valid_chunk_id(i)]
            held = self.store.held(job, wanted, touch=action == "/touch")
        except (ValueError, KeyError, TypeError):
            self._reply(400, b"")
            return
        self._reply(200, json.dumps({"ids": held}).encode(), "application/json")

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/healthz":
            self._reply(200, b"ok")
            return
        if not self._authorized() or self._body_length(maximum=0) is None:
            return
        job, action = self._route()  # type: ignore[misc]
        chunk_id = self._chunk(action)
        if chunk_id is None:
            return
        f = self.store.open(job, chunk_id)
        if f is None:
            self._reply(404, b"")
            return
        with f:
            bad = send_chunk_range(self, f, self.deadline, self.limits.send_deadline_s)
        if bad is not None:
            self._reply(bad, b"")

    def do_PUT(self) -> None:  # noqa: N802
        if not self._authorized():
            return
        job, action = self._route()  # type: ignore[misc]
        chunk_id = self._chunk(action)
        if chunk_id is None:
            return
        length = self._body_length(MAX_CHUNK_BYTES)
        if length is None:
            return
        self.deadline.reset(self.limits.send_deadline_s, "the chunk's body")
        with self.store.writing(job, chunk_id, length) as f:
            if f is None:  # the node's bound is taken by writes in flight: try later
                self._reply(507, b"")  # closes the connection: the body is never read
                return
            left = length
            while left:
                piece = self.rfile.read(min(PIECE, left))
                if not piece:
                    break
                f.write(piece)
                left -= len(piece)
        if left:  # it hung up: nothing was kept
            self.close_connection = True
            return
        self._reply(204, b"")

    def do_DELETE(self) -> None:  # noqa: N802
        if not self._authorized() or self._body_length(maximum=0) is None:
            return
        job, action = self._route()  # type: ignore[misc]
        chunk_id = self._chunk(action)
        if chunk_id is not None:
            self.store.discard(job, chunk_id)
            self._reply(204, b"")


def serve_agent(
    store: NodeStore,
    *,
    key: bytes,
    host: str = "0.0.0.0",
    port: int = 0,
    limits: PeerServerLimits | None = None,
) -> PeerCacheServer:
    """Serve ``store`` on a thread; port 0 picks a free one. Stop it with
    ``server.shutdown(); server.server_close()``."""
    job_token(key, "n", "j", "u")  # a key too short: refused here, not per request
    limits = PeerServerLimits.from_env() if limits is None else limits
    handler: Any = type(
        "AgentHandler",
        (_AgentHandler,),
        {"store": store, "key": key, "limits": limits, "cache": None, "token": b"",
         "timeout": limits.header_deadline_s},
    )  # fmt: skip
    server = PeerCacheServer((host, port), handler, limits)
    threading.Thread(target=server.serve_forever, name="ctj-node-agent", daemon=True).start()
    return server
