"""The node's chunk cache, every job's, bounded per node: what the agent holds on disk.

Layout: ``<root>/<namespace>/<job>/<uid>/<id[:2]>/<id>`` (the on-disk layout of
store/chunk_cache.py under each job's directory), plus ``<uid>/.created`` whose mtime is
when the directory was made (the collector's race guard, gc.py). The uid is in the path
so that a job deleted and made again under its name starts empty, and a token (derived
from the uid) opens only its own directory.

One process (the agent) writes here, so the bound is kept in memory, not by rescanning:
an index of every entry in least-recently-used order across all jobs, plus the bytes of
writes in flight. A write first reserves its size: entries are evicted, oldest first
across jobs, until the held plus the reserved fit the bound (down to ``EVICT_TO`` of it,
so eviction runs now and then); a write in flight is not in the index, so it is never
evicted; if the writes in flight alone fill the bound, the write is refused. A chunk
evicted while being read stays readable through its open file.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO, TypeVar

from ..store.chunk_cache import valid_chunk_id

log = logging.getLogger(__name__)

EVICT_TO = 0.9
CREATED = ".created"
TMP = ".tmp"


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class JobKey:
    """One job incarnation: its directory is ``<namespace>/<name>/<uid>``."""

    namespace: str
    name: str
    uid: str

    @property
    def relative(self) -> str:
        return f"{self.namespace}/{self.name}/{self.uid}"


K = TypeVar("K")


def plan_evictions(
    lru: Iterable[tuple[K, int]], held: int, reserved: int, incoming: int, max_bytes: int
) -> list[K] | None:
    """Which entries to evict (oldest first from ``lru``: (key, size)) so that ``incoming``
    more bytes fit beside ``held`` and the writes in flight (``reserved``); none when they
    fit already; else down to ``EVICT_TO`` of ``max_bytes``. None: it cannot fit even with
    every entry gone (the writes in flight take the bound)."""
    if reserved + incoming > max_bytes:
        return None
    if held + reserved + incoming <= max_bytes:
        return []
    target = max(int(max_bytes * EVICT_TO) - reserved - incoming, 0)
    chosen: list[K] = []
    for key, size in lru:
        if held <= target:
            break
        chosen.append(key)
        held -= size
    return chosen


class NodeStore:
    """Every job's chunks on this node (module docstring); thread-safe."""

    def __init__(self, root: str | os.PathLike[str], max_bytes: int) -> None:
        if max_bytes <= 0:
            raise ValueError("the node cache needs max_bytes > 0")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._lru: collections.OrderedDict[tuple[JobKey, str], int] = collections.OrderedDict()
        self._held = 0
        self._reserved = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._load()

    # -- what is here ------------------------------------------------------------------

    def _load(self) -> None:
        """Index what an earlier run left, oldest use first; drop unfinished writes."""
        found: list[tuple[float, JobKey, str, int]] = []
        for job in self.jobs():
            shutil.rmtree(self.dir(job) / TMP, ignore_errors=True)  # no write is in flight
            for sub in _scandir(self.dir(job)):
                if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                    continue
                for f in _scandir(Path(sub.path)):
                    if valid_chunk_id(f.name):
                        with contextlib.suppress(OSError):
                            st = f.stat(follow_symlinks=False)
                            found.append((st.st_mtime, job, f.name, st.st_size))
        for _, job, chunk_id, size in sorted(found, key=lambda e: e[0]):
            self._lru[(job, chunk_id)] = size
            self._held += size

    def jobs(self) -> list[JobKey]:
        """Every job directory on the node."""
        out = []
        for ns in _scandir(self.root):
            for name in _scandir(Path(ns.path)):
                for uid in _scandir(Path(name.path)):
                    if uid.is_dir(follow_symlinks=False):
                        out.append(JobKey(ns.name, name.name, uid.name))
        return out

    def created(self, job: JobKey) -> float:
        """When the job's directory was made (its marker's mtime, else the directory's)."""
        for path in (self.dir(job) / CREATED, self.dir(job)):
            with contextlib.suppress(OSError):
                return path.stat().st_mtime
        return 0.0

    def dir(self, job: JobKey) -> Path:
        return self.root / job.namespace / job.name / job.uid

    def path(self, job: JobKey, chunk_id: str) -> Path:
        if not valid_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        return self.dir(job) / chunk_id[:2] / chunk_id

    @property
    def bytes_held(self) -> int:
        return self._held

    def bytes_of(self, job: JobKey) -> int:
        with self._lock:
            return sum(size for (j, _), size in self._lru.items() if j == job)

    # -- reads -------------------------------------------------------------------------

    def held(self, job: JobKey, chunk_ids: Iterable[str], *, touch: bool = False) -> list[str]:
        with self._lock:
            found = [c for c in chunk_ids if (job, c) in self._lru]
            if touch:
                for c in found:
                    self._lru.move_to_end((job, c))
        return found

    def open(self, job: JobKey, chunk_id: str) -> BinaryIO | None:
        """The entry open for reading (readable even if evicted meanwhile), or None; marks
        it used."""
        with self._lock:
            if (job, chunk_id) not in self._lru:
                return None
            self._lru.move_to_end((job, chunk_id))
        try:
            return open(self.path(job, chunk_id), "rb")  # noqa: SIM115 - the caller closes it
        except (OSError, ValueError):
            self._forget(job, chunk_id)
            return None

    # -- writes ------------------------------------------------------------------------

    @contextlib.contextmanager
    def writing(self, job: JobKey, chunk_id: str, size: int) -> Iterator[BinaryIO | None]:
        """A file to write the chunk's ``size`` bytes to, or None when the node's bound is
        taken by writes in flight. The entry appears (whole) when the block ends without
        an exception and the file holds ``size`` bytes; else nothing is left."""
        if not valid_chunk_id(chunk_id):
            raise ValueError(f"not a chunk id: {chunk_id!r}")
        if not self._reserve(size):
            yield None
            return
        tmp: Path | None = None
        try:
            tmp_dir = self._job_dir(job) / TMP
            tmp_dir.mkdir(exist_ok=True)
            tmp = tmp_dir / uuid.uuid4().hex
            with open(tmp, "wb") as f:
                yield f
                written = f.tell()
            if written != size:
                return
            final = self.path(job, chunk_id)
            final.parent.mkdir(exist_ok=True)
            os.replace(tmp, final)  # a collector that removed the job's directory: raises
            tmp = None
            with self._lock:
                previous = self._lru.pop((job, chunk_id), None)
                self._held += size - (previous or 0)
                self._lru[(job, chunk_id)] = size
        finally:
            with self._lock:
                self._reserved -= size
            if tmp is not None:
                with contextlib.suppress(OSError):
                    tmp.unlink()

    def _job_dir(self, job: JobKey) -> Path:
        return make_job_dir(self.root, job)

    def _reserve(self, size: int) -> bool:
        with self._lock:
            lru = ((key, s) for key, s in self._lru.items())
            chosen = plan_evictions(lru, self._held, self._reserved, size, self.max_bytes)
            if chosen is None:
                return False
            for key in chosen:
                self._held -= self._lru.pop(key)
            self._reserved += size
        for job, chunk_id in chosen:
            with contextlib.suppress(OSError):
                self.path(job, chunk_id).unlink()
        return True

    def discard(self, job: JobKey, chunk_id: str) -> None:
        """Drop an entry whose bytes failed a reader's check."""
        if self._forget(job, chunk_id):
            with contextlib.suppress(OSError):
                self.path(job, chunk_id).unlink()

    def _forget(self, job: JobKey, chunk_id: str) -> bool:
        with self._lock:
            size = self._lru.pop((job, chunk_id), None)
            if size is not None:
                self._held -= size
        return size is not None

    def remove_job(self, job: JobKey) -> int:
        """Remove the job's directory and its entries; the bytes freed. A write of the job
        in flight fails its rename (its directory is gone) and leaves nothing."""
        with self._lock:
            keys = [k for k in self._lru if k[0] == job]
            freed = sum(self._lru.pop(k) for k in keys)
            self._held -= freed
        shutil.rmtree(self.dir(job), ignore_errors=True)
        for parent in (self.dir(job).parent, self.dir(job).parent.parent):
            with contextlib.suppress(OSError):
                parent.rmdir()  # only when empty: another uid or job may live there
        return freed


def make_job_dir(root: Path, job: JobKey) -> Path:
    """The job's directory, made (with its ``.created`` marker) if it is not there: by the
    agent's first write for the job, or by the CSI endpoint mounting it into a pod of the
    job (agent/csi.py); either happens only after the job exists (gc.py's race guard)."""
    path = root / job.relative
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        (path / CREATED).touch()
    return path


def _scandir(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return [e for e in it if not e.name.startswith(".")]
    except OSError:
        return []


def now() -> float:
    """The wall clock the directories' mtimes are compared with (gc.py)."""
    return time.time()
