"""The node-local chunk cache: committed chunks kept on the node, bounded, evicted LRU.

The fastest restore never goes to S3. A chunk is named by the BLAKE3 of its
content, so a cached copy can never be stale, only missing or damaged, and a
reader that checks every block against the manifest (load/chunk_reader.py)
needs nothing from the cache but bytes. That makes the rules here simple:

* Entries are a chunk's **raw** bytes (decoded, whatever its stored codec), at
  ``<root>/<id[:2]>/<id>``, so ranged reads work for every chunk.
* A write goes to a private temporary file, then is renamed into place: a
  reader sees a whole entry or none. A torn or damaged entry (a node crash, a
  disk error) fails its hash check where it is read; the reader drops it and
  goes to the next tier.
* The size is bounded: once the entries exceed ``max_bytes``, the least
  recently used go (a read or a re-save touches an entry's mtime) until the
  cache is at 90% of its bound. Several processes of a node (the ranks and
  their sidecars) share one cache; each evicts by the same rule, and a file
  evicted while another process reads it stays readable through its open fd.
* The cache is an optimisation: an I/O error writing it is logged once and
  the cache is switched off for this process, never a failed save.

In a pod the node's cache is not a directory of the pod's but the node agent's
(trainer_sidecar/agent/): the pod reaches it through ``store.agent_client.AgentCache``,
which has the same reading and writing methods (``NodeChunks``). This class is the
on-disk layout, used by the agent for each job's directory and by runs outside a
cluster that give ``CTJ_CACHE_DIR``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

log = logging.getLogger(__name__)

_CHUNK_ID = re.compile(r"[0-9a-f]{64}")
EVICT_TO = 0.9  # of max_bytes, so eviction runs now and then, not on every put
STALE_TMP_S = 3600.0  # a temporary file this old is a write a crash cut short


def valid_chunk_id(chunk_id: str) -> bool:
    """A chunk id as the format names them (64 hex digits): nothing else becomes a path."""
    return bool(_CHUNK_ID.fullmatch(chunk_id))


class NodeChunks(Protocol):
    """The node's chunk cache as the engine uses it (the uploader keeps what it saved, a
    restore reads first and drops what fails its check, replication adds a neighbour's
    share): a directory here (``ChunkCache``), or the node agent (``AgentCache``). Every
    method is best effort: a miss or a failure is None / nothing, never an exception."""

    def held(self, chunk_ids: Iterable[str]) -> set[str]: ...
    def read(self, chunk_id: str, start: int, end: int) -> bytes | None: ...
    def discard(self, chunk_id: str) -> None: ...
    def keep(self, chunk_id: str, data: bytes | memoryview) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class CacheEntry:
    chunk_id: str
    size: int
    used: float  # mtime: the last read or write


class ChunkCache:
    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("a chunk cache needs max_bytes > 0")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._broken = False
        try:
            self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as exc:
            self._switch_off(exc)
        self._bytes = sum(e.size for e in self.entries())

    def _switch_off(self, exc: OSError) -> None:
        self._broken = True
        log.warning(
            "node-local chunk cache %s: %s; not caching in this process any more",
            self.root, exc.strerror or type(exc).__name__,
        )  # fmt: skip

    def path(self, chunk_id: str) -> Path:
        if not valid_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        return self.root / chunk_id[:2] / chunk_id

    # -- reads -----------------------------------------------------------------

    def size_of(self, chunk_id: str) -> int | None:
        try:
            return self.path(chunk_id).stat().st_size
        except (OSError, ValueError):
            return None

    def held(self, chunk_ids: Iterable[str]) -> set[str]:
        """Which of these chunks are here."""
        return {c for c in chunk_ids if self.size_of(c) is not None}

    def open(self, chunk_id: str) -> BinaryIO | None:
        """The entry, open for reading (it stays readable if evicted meanwhile), or None.
        Touches it (LRU)."""
        try:
            f = open(self.path(chunk_id), "rb")  # noqa: SIM115 - the caller closes it
        except (OSError, ValueError):
            return None
        _touch(f.fileno())
        return f

    def read(self, chunk_id: str, start: int, end: int) -> bytes | None:
        """Raw bytes [start, end) of the entry, or None if it is not here (or too short:
        the caller's hash check would refuse it anyway). Touches the entry (LRU)."""
        try:
            with open(self.path(chunk_id), "rb") as f:
                data = os.pread(f.fileno(), end - start, start)
                _touch(f.fileno())
        except (OSError, ValueError):
            return None
        return data if len(data) == end - start else None

    def discard(self, chunk_id: str) -> None:
        """Drop an entry that failed its hash check."""
        try:
            path = self.path(chunk_id)
            size = path.stat().st_size
            path.unlink()
        except (OSError, ValueError):
            return
        with self._lock:
            self._bytes -= size

    # -- writes ----------------------------------------------------------------

    def keep(self, chunk_id: str, data: bytes | memoryview) -> None:
        """Hold this chunk's raw bytes: write it if absent, else mark it used."""
        if self._broken:
            return
        path = self.path(chunk_id)
        try:
            if path.exists():
                os.utime(path)
                return
            path.parent.mkdir(exist_ok=True, mode=0o700)
            tmp = path.with_name(f".{chunk_id}.{os.getpid()}.{threading.get_ident()}.tmp")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            self._switch_off(exc)
            return
        with self._lock:
            self._bytes += len(data)
            over = self._bytes > self.max_bytes
        if over:
            self.evict()

    def evict(self) -> int:
        """Remove least recently used entries until at most EVICT_TO of the bound; the
        bytes removed. Recounts from disk (other processes write here too)."""
        with self._lock:
            entries = sorted(self.entries(), key=lambda e: e.used)
            total = sum(e.size for e in entries)
            target = int(self.max_bytes * EVICT_TO)
            removed = 0
            for entry in entries:
                if total <= target:
                    break
                try:
                    (self.root / entry.chunk_id[:2] / entry.chunk_id).unlink()
                except OSError:
                    continue  # another process evicted it first
                total -= entry.size
                removed += entry.size
            self._bytes = total
        return removed

    def entries(self) -> list[CacheEntry]:
        out = []
        stale = time.time() - STALE_TMP_S
        for sub in _scandir(self.root):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for f in _scandir(Path(sub.path)):
                if not valid_chunk_id(f.name):
                    _remove_if_stale(f, stale)  # a write in flight, or one a crash left
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                out.append(CacheEntry(f.name, st.st_size, st.st_mtime))
        return out

    @property
    def bytes_held(self) -> int:
        return self._bytes


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _remove_if_stale(entry: os.DirEntry[str], before: float) -> None:
    try:
        if entry.name.endswith(".tmp") and entry.stat(follow_symlinks=False).st_mtime < before:
            os.unlink(entry.path)
    except OSError:
        pass


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:
        pass  # a read-only mount: LRU degrades to insertion order
