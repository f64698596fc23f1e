"""Upload one rank's staged files: chunk, hash, deduplicate, store, report the part.

Memory stays bounded: the staged file is memory-mapped, and at most
``parallelism * 2`` chunks are in flight (hashing, compressing or uploading)
at once. Chunks already in the reference checkpoint, or already sent by this
upload, are not sent again.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import functools
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import zstandard

from ..errors import UploadAborted
from ..format import chunking
from ..format.manifest import ChunkRef, FileEntry, RankPart, part_key
from ..store.base import ObjectStore

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class StagedFile:
    name: str  # the DCP file name within the checkpoint
    path: str
    items: tuple[chunking.Span, ...]  # item extents in the file, for chunk alignment


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UploadSettings:
    chunk_size: int = chunking.DEFAULT_CHUNK_SIZE
    block_size: int = chunking.DEFAULT_BLOCK_SIZE
    pack_size: int = chunking.DEFAULT_PACK_SIZE
    parallelism: int = 8
    compression: str = "none"  # none | zstd
    zstd_level: int = 1


@contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    size = os.path.getsize(path)
    if size == 0:
        yield memoryview(b"")
        return
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()


class _Dedup:
    """Chunk ids that need no upload: the reference's, plus those this upload claimed."""

    def __init__(self, reference: set[str]) -> None:
        self._known = set(reference)
        self._lock = threading.Lock()

    def claim(self, chunk_id: str) -> bool:
        """True if the caller should upload this chunk (first to see it)."""
        with self._lock:
            if chunk_id in self._known:
                return False
            self._known.add(chunk_id)
            return True


def upload_rank(
    store: ObjectStore,
    *,
    step: int,
    rank: int,
    files: list[StagedFile],
    reference: set[str],
    settings: UploadSettings,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> RankPart:
    """Upload the files, write ``parts/<step>/rank-<r>.json``, return that part."""
    started = time.monotonic()
    dedup = _Dedup(reference)
    uploaded = deduplicated = 0
    counter_lock = threading.Lock()
    entries: dict[str, FileEntry] = {}

    def one_chunk(whole: memoryview, span: chunking.Span) -> ChunkRef:
        nonlocal uploaded, deduplicated
        if should_stop is not None and should_stop():
            raise UploadAborted(f"upload of step {step} (rank {rank}) stopped")
        with whole[span.offset : span.end] as view:  # released here, so the map can close
            cid, blocks = chunking.hash_chunk(view, settings.block_size)
            codec = settings.compression
            stored_size = len(view)
            if dedup.claim(cid):
                body: bytes | memoryview = view
                if codec == "zstd":
                    body = zstandard.ZstdCompressor(level=settings.zstd_level).compress(view)
                    stored_size = len(body)
                store.put(ChunkRef(cid, 0, 0, codec, ()).key, body)
                with counter_lock:
                    uploaded += len(view)
            else:
                with counter_lock:
                    deduplicated += len(view)
        if progress:
            progress(span.length)
        return ChunkRef(cid, span.length, stored_size, codec, tuple(blocks))

    with cf.ThreadPoolExecutor(settings.parallelism, thread_name_prefix="ctj-upload") as pool:
        for staged in files:
            with _mapped(staged.path) as view:
                spans = chunking.plan_chunks(
                    staged.items,
                    file_size=len(view),
                    chunk_size=settings.chunk_size,
                    pack_size=min(settings.pack_size, settings.chunk_size),
                )
                refs = _run_bounded(
                    pool, spans, functools.partial(one_chunk, view), limit=settings.parallelism * 2
                )
                entries[staged.name] = FileEntry(len(view), tuple(refs))
    part = RankPart(
        step=step,
        rank=rank,
        files=entries,
        uploaded_bytes=uploaded,
        deduplicated_bytes=deduplicated,
        upload_seconds=time.monotonic() - started,
    )
    if should_stop is not None and should_stop():
        raise UploadAborted(f"upload of step {step} (rank {rank}) stopped before its part")
    store.put(part_key(step, rank), part.to_bytes())
    return part


def _run_bounded(
    pool: cf.ThreadPoolExecutor,
    spans: list[chunking.Span],
    fn: Callable[[chunking.Span], ChunkRef],
    *,
    limit: int,
) -> list[ChunkRef]:
    """fn over spans in order, at most ``limit`` in flight; the first error cancels the rest."""
    results: list[ChunkRef | None] = [None] * len(spans)
    pending: dict[cf.Future[ChunkRef], int] = {}
    try:
        for i, span in enumerate(spans):
            if len(pending) >= limit:
                _drain_one(pending, results)
            pending[pool.submit(fn, span)] = i
        while pending:
            _drain_one(pending, results)
    finally:
        for fut in pending:
            fut.cancel()
        cf.wait(pending)
    return [r for r in results if r is not None]


def _drain_one(pending: dict[cf.Future[ChunkRef], int], results: list[ChunkRef | None]) -> None:
    done, _ = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
    for fut in done:
        results[pending.pop(fut)] = fut.result()
