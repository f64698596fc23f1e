"""The node agent's cache, as a pod's processes use it: the same methods as a cache directory.

A training pod has no hostPath: the node's chunk cache belongs to the node agent
(trainer_sidecar/agent/), a DaemonSet pod that the pods of every job on the node reach at
the node's address (``status.hostIP``, the agent's hostPort). ``AgentCache`` gives the
uploader, the restore's tiers and replication what ``ChunkCache`` gives them
(``chunk_cache.NodeChunks``), over the peer protocol's HTTP (store/peers.py), scoped to
one job and authenticated with its token:

    POST   <job>/has          {"ids": [...]}   -> {"ids": [the ones held]}
    POST   <job>/touch        {"ids": [...]}   -> the same, and marks those used (LRU)
    GET    <job>/chunks/<id>  Range: bytes=a-b -> 206, the raw bytes [a, b]
    PUT    <job>/chunks/<id>  the raw bytes    -> 204 (held from now on)
    DELETE <job>/chunks/<id>                   -> 204 (its bytes failed a check)

where ``<job>`` is ``/v1/jobs/<namespace>/<name>/<uid>`` (``job_path``). Where the pod
mounts its job's directory of the agent's cache (``mount``: the agent's CSI volume,
read-only), what is held and its bytes are read there instead, with ``pread`` from the
page cache (no socket: docs/node-agent.md, "The mount"); writes still go to the agent,
which owns the directory and its bound. The agent
recomputes the job's token from that path (ctj_contract.tokens) and answers 401 to any
other. Every request has the peer client's wall-clock deadline (store/peer_limits.py);
the cache is an optimisation, so a failed request is a miss, and after one the agent is
left alone for a while (a save never waits on an agent that is down): ``FIRST_PAUSE_S``,
doubled after each failure in a row up to ``PAUSE_S``. A pod's first requests can fail
for a moment (a network policy enforcer that has not yet seen the new pod's address, an
agent restarting): the node cache is then back within a second or two, not half a minute.
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Iterable
from pathlib import Path

from .chunk_cache import valid_chunk_id
from .peer_limits import MAX_HAS_IDS, PeerClientLimits
from .peer_wire import PeerProtocolError
from .peers import Requester, split_address

log = logging.getLogger(__name__)

FIRST_PAUSE_S = 1.0
"""After a failed request, the agent is not asked again for this long ..."""
PAUSE_S = 30.0
"""... doubled after each further failure in a row, up to this."""
MAX_CHUNK_BYTES = 64 << 20
"""The largest chunk (format/chunking: at most 64 MiB): the most a PUT may carry."""

_NAMESPACE = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_NAME = r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?"
_UID = r"[a-z0-9]([-a-z0-9]{0,62}[a-z0-9])?"
JOB_PATH = re.compile(rf"/v1/jobs/(?P<ns>{_NAMESPACE})/(?P<name>{_NAME})/(?P<uid>{_UID})")


def pause_after(failures: int) -> float:
    """How long the agent is left alone after ``failures`` failed requests in a row."""
    return min(PAUSE_S, FIRST_PAUSE_S * 2.0 ** min(failures - 1, 32))


def job_path(namespace: str, name: str, uid: str) -> str:
    """The job's prefix on a node agent; ValueError for a part Kubernetes would not allow."""
    path = f"/v1/jobs/{namespace}/{name}/{uid}"
    if not JOB_PATH.fullmatch(path) or ".." in name:
        raise ValueError(f"job {namespace}/{name} (uid {uid!r}) cannot name a node agent path")
    return path


class AgentCache:
    """The node agent's cache of one job (``chunk_cache.NodeChunks``), thread-safe."""

    def __init__(
        self,
        agent: str,
        path: str,
        *,
        token: str,
        limits: PeerClientLimits | None = None,
        mount: str | os.PathLike[str] | None = None,
    ) -> None:
        """``agent``: host:port of the node's agent; ``path``: ``job_path(...)``;
        ``mount``: where the job's directory of the agent's cache is mounted, if it is."""
        split_address(agent)
        self.agent, self.path = agent, path
        self.mount = Path(mount) if mount else None
        self.limits = PeerClientLimits.from_env() if limits is None else limits
        self._http = Requester(token, self.limits)
        self._paused_until = 0.0
        self._failures = 0  # in a row: the next pause is FIRST_PAUSE_S doubled this often
        self._lock = threading.Lock()

    # -- NodeChunks --------------------------------------------------------------------

    def held(self, chunk_ids: Iterable[str]) -> set[str]:
        if self.mount is not None:
            return {c for c in chunk_ids if self._local_size(c) is not None}
        return self._ids("/has", chunk_ids)

    def read(self, chunk_id: str, start: int, end: int) -> bytes | None:
        if not valid_chunk_id(chunk_id) or not 0 <= start < end:
            return None
        if self.mount is not None:
            data = self._read_local(chunk_id, start, end)
            if data is not None:
                return data  # else ask the agent: a mount of a directory made anew since
        answer = self._call(
            "GET", f"/chunks/{chunk_id}", {"Range": f"bytes={start}-{end - 1}"},
            max_body=end - start,
        )  # fmt: skip
        if answer is None or answer[0] != 206 or len(answer[1]) != end - start:
            return None
        return answer[1]

    def discard(self, chunk_id: str) -> None:
        if valid_chunk_id(chunk_id):
            self._call("DELETE", f"/chunks/{chunk_id}", max_body=0)

    def keep(self, chunk_id: str, data: bytes | memoryview) -> None:
        """Hold these raw bytes on the node: sent only if the agent does not hold them
        already (an unchanged chunk of an incremental save costs a small request)."""
        if not valid_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        if len(data) > MAX_CHUNK_BYTES or self._ids("/touch", [chunk_id]) or self._paused():
            return
        self._call(
            "PUT", f"/chunks/{chunk_id}", body=data, max_body=0,
            content_type="application/octet-stream",
        )  # fmt: skip

    # -- the mount ---------------------------------------------------------------------

    def _local(self, chunk_id: str) -> Path:
        assert self.mount is not None
        return self.mount / chunk_id[:2] / chunk_id  # the agent's layout (agent/store.py)

    def _local_size(self, chunk_id: str) -> int | None:
        if not valid_chunk_id(chunk_id):
            return None
        try:
            st = self._local(chunk_id).stat()
        except OSError:
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def _read_local(self, chunk_id: str, start: int, end: int) -> bytes | None:
        try:
            fd = os.open(self._local(chunk_id), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        try:
            data = os.pread(fd, end - start, start)
        except OSError:
            return None
        finally:
            os.close(fd)
        return data if len(data) == end - start else None

    # -- requests ----------------------------------------------------------------------

    def _ids(self, action: str, chunk_ids: Iterable[str]) -> set[str]:
        wanted = sorted({c for c in chunk_ids if valid_chunk_id(c)})
        held: set[str] = set()
        for i in range(0, len(wanted), MAX_HAS_IDS):
            batch = wanted[i : i + MAX_HAS_IDS]
            body = json.dumps({"ids": batch}).encode()
            answer = self._call("POST", action, body=body, max_body=len(body) + 1024)
            if answer is None or answer[0] != 200:
                return held
            try:
                found = json.loads(answer[1])["ids"]
                held.update(c for c in found if isinstance(c, str) and c in set(batch))
            except (ValueError, KeyError, TypeError):
                self._failed("answered nonsense to a has-query")
                return held
        return held

    def _call(
        self,
        method: str,
        action: str,
        headers: dict[str, str] | None = None,
        *,
        body: bytes | memoryview | None = None,
        max_body: int,
        content_type: str = "application/json",
    ) -> tuple[int, bytes] | None:
        """(status, body) of a 2xx answer; None for a miss (404) or a failure (which
        pauses the agent)."""
        if self._paused():
            return None
        size = len(body) if body is not None else max_body
        try:
            status, data = self._http.request(
                self.agent, method, self.path + action, headers, body,
                max_body=max_body, seconds=self.limits.deadline_s(size),
                content_type=content_type,
            )  # fmt: skip
        except (OSError, ValueError, PeerProtocolError) as exc:
            self._failed(f"failed ({type(exc).__name__}: {exc})")
            return None
        # 404: a miss; 507: the node's bound is taken by writes in flight (the agent is fine)
        if status >= 300 and status not in (404, 507):
            self._failed(f"answered HTTP {status} to {method}")
            return None
        self._answered()
        return (status, data) if status < 300 else None

    def _paused(self) -> bool:
        with self._lock:
            return time.monotonic() < self._paused_until

    def _answered(self) -> None:
        with self._lock:
            back, self._failures = self._failures > 0, 0
        if back:
            log.info("node agent %s answers again: using the node's cache", self.agent)

    def _failed(self, why: str) -> None:
        with self._lock:
            if time.monotonic() < self._paused_until:
                return  # a request begun before the pause: this failure is already counted
            self._failures += 1
            pause = pause_after(self._failures)
            self._paused_until = time.monotonic() + pause
        log.warning(
            "node agent %s %s: not using the node's cache for %.0fs", self.agent, why, pause
        )
