"""Upload one rank's staged files: chunk, hash, deduplicate, store, report the part.

Last come this rank's rank manifest (its chunk lists, at the hash of its bytes) and
then its part (a small pointer to it): a part in the store means its rank manifest
and every chunk it names are there.

Memory stays bounded: the staged file is memory-mapped, and at most
``parallelism * 2`` chunks are in flight (hashing, compressing or uploading)
at once. Chunks already in the reference checkpoint, or already sent by this
upload, are not sent again.

Deduplication keys on the stored object, not just the content id: a chunk the
reference holds is named exactly as the reference stored it (its codec, its
stored size), whatever this save's compression is, so switching compression
between saves or runs never names an object that does not exist.

Each chunk's codec follows the ``compression`` setting and what the chunk holds
(format/codecs.py: ``auto`` splits a chunk of one float tensor into byte planes);
a chunk that compression would barely shrink is stored raw.
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
from typing import TypeVar

from ..errors import UploadAborted
from ..format import chunking, codecs
from ..format.manifest import (
    ChunkRef,
    Codec,
    FileEntry,
    RankManifest,
    RankPart,
    SaveIdentity,
    rank_manifest_key,
)
from ..store.base import ObjectStore
from ..store.chunk_cache import NodeChunks
from ..store.commit import store_part
from ..store.gc_fence import SaveFence

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class StagedFile:
    name: str  # the DCP file name within the checkpoint
    path: str
    items: tuple[chunking.Span, ...]  # item extents and dtypes: chunk alignment, codecs


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class UploadSettings:
    chunk_size: int = chunking.DEFAULT_CHUNK_SIZE
    block_size: int = chunking.DEFAULT_BLOCK_SIZE
    pack_size: int = chunking.DEFAULT_PACK_SIZE
    parallelism: int = 8
    compression: codecs.Compression = codecs.Compression.NONE
    zstd_level: int = codecs.DEFAULT_ZSTD_LEVEL


@contextmanager
def _mapped(path: str) -> Iterator[memoryview]:
    size = os.path.getsize(path)
    if size == 0:
        yield memoryview(b"")
        return
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        view = memoryview(m)
        try:
            yield view
        finally:
            view.release()
            try:
                m.close()
            except BufferError:  # a view kept alive elsewhere: the mapping goes with it
                log.debug("%s: a view outlived the upload; unmapped when it goes", path)


class _Dedup:
    """Chunks that need no upload: the reference's stored objects, and this upload's own."""

    def __init__(self, reference: dict[str, ChunkRef]) -> None:
        self._reference = reference  # by chunk id
        self._claimed: dict[str, cf.Future[ChunkRef]] = {}
        self._lock = threading.Lock()

    def claim(self, chunk_id: str) -> tuple[ChunkRef | cf.Future[ChunkRef], bool]:
        """(the stored chunk, or a future of it; True if the caller must upload it)."""
        with self._lock:
            if chunk_id in self._reference:
                return self._reference[chunk_id], False
            if chunk_id in self._claimed:
                return self._claimed[chunk_id], False
            fut: cf.Future[ChunkRef] = cf.Future()
            self._claimed[chunk_id] = fut
            return fut, True


def upload_rank(
    store: ObjectStore,
    *,
    step: int,
    rank: int,
    save: SaveIdentity,
    world_size: int,
    files: list[StagedFile],
    reference: dict[str, ChunkRef],
    settings: UploadSettings,
    progress: Callable[[int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
    cache: NodeChunks | None = None,
    fence: SaveFence | None = None,
) -> RankPart:
    """Upload the files, store this save's part for the rank, return that part.

    ``reference`` maps chunk ids to how the reference checkpoint stored them.
    ``cache``: the node-local chunk cache, given every chunk of the save (raw).
    ``fence``: opened before anything was stored; settled (store/gc_fence.py) once every
    chunk is, before the rank manifest names them: a chunk a gc run deleted meanwhile is
    stored again from the staged bytes.
    """
    started = time.monotonic()
    dedup = _Dedup(reference)
    uploaded = deduplicated = 0
    counter_lock = threading.Lock()
    entries: dict[str, FileEntry] = {}
    sources: dict[str, tuple[StagedFile, chunking.Span, Codec]] = {}  # by stored key

    def one_chunk(
        whole: memoryview, staged: StagedFile, planned: tuple[chunking.Span, Codec]
    ) -> ChunkRef:
        nonlocal uploaded, deduplicated
        span, codec = planned
        if should_stop is not None and should_stop():
            raise UploadAborted(f"upload of step {step} (rank {rank}) stopped")
        with whole[span.offset : span.end] as view:  # released here, so the map can close
            cid, blocks = chunking.hash_chunk(view, settings.block_size)
            known, mine = dedup.claim(cid)
            if mine:
                assert isinstance(known, cf.Future)
                try:
                    ref = _store_chunk(store, view, cid, tuple(blocks), codec, settings)
                except BaseException as exc:
                    known.set_exception(exc)
                    raise
                known.set_result(ref)
                with counter_lock:
                    uploaded += len(view)
            if cache is not None:  # the node keeps what it saved, for a restart here
                cache.keep(cid, view)
        if not mine:
            # the reference's object as stored, or this upload's own (a chunk seen twice)
            ref = known.result() if isinstance(known, cf.Future) else known
            with counter_lock:
                deduplicated += span.length
        with counter_lock:
            sources.setdefault(ref.key, (staged, span, codec))
        if progress:
            progress(span.length)
        return ref

    with cf.ThreadPoolExecutor(settings.parallelism, thread_name_prefix="ctj-upload") as pool:
        for staged in files:
            with _mapped(staged.path) as view:
                spans = chunking.plan_chunks(
                    staged.items,
                    file_size=len(view),
                    chunk_size=settings.chunk_size,
                    pack_size=min(settings.pack_size, settings.chunk_size),
                )
                kinds = codecs.chunk_dtypes(staged.items, spans)
                planned = [
                    (span, codecs.choose(settings.compression, k))
                    for span, k in zip(spans, kinds, strict=True)
                ]
                fn = functools.partial(one_chunk, view, staged)
                refs = _run_bounded(pool, planned, fn, limit=settings.parallelism * 2)
                entries[staged.name] = FileEntry(len(view), tuple(refs))
    if fence is not None:
        entries = _settle(fence, store, entries, sources, settings)
    rank_manifest = RankManifest(
        step=step, rank=rank, save=save, block_size=settings.block_size, files=entries
    )
    body = rank_manifest.to_bytes()
    part = RankPart.of(
        rank_manifest,
        body,
        world_size=world_size,
        uploaded_bytes=uploaded,
        deduplicated_bytes=deduplicated,
        upload_seconds=time.monotonic() - started,
    )
    if should_stop is not None and should_stop():
        raise UploadAborted(f"upload of step {step} (rank {rank}) stopped before its part")
    store.put(rank_manifest_key(part.manifest), body)  # content-addressed: a retry rewrites it
    store_part(store, part)
    if fence is not None:
        fence.release()  # the part names every chunk now: gc marks them through it
    return part


def _settle(
    fence: SaveFence,
    store: ObjectStore,
    entries: dict[str, FileEntry],
    sources: dict[str, tuple[StagedFile, chunking.Span, Codec]],
    settings: UploadSettings,
) -> dict[str, FileEntry]:
    """The entries once no gc run can delete what they name: each chunk a run deleted is
    stored again from its staged bytes (and named as stored now)."""
    again: dict[str, ChunkRef] = {}  # by the key first stored (or named from the reference)

    def names() -> set[str]:
        return {again[k].key if k in again else k for k in sources}

    def store_again(lost: set[str]) -> None:
        for first in [k for k in sources if (again[k].key if k in again else k) in lost]:
            staged, span, codec = sources[first]
            with _mapped(staged.path) as whole, whole[span.offset : span.end] as view:
                cid, blocks = chunking.hash_chunk(view, settings.block_size)
                again[first] = _store_chunk(store, view, cid, tuple(blocks), codec, settings)

    fence.settle(names, store_again)
    return {
        name: FileEntry(e.size, tuple(again.get(c.key, c) for c in e.chunks))
        for name, e in entries.items()
    }


def _store_chunk(
    store: ObjectStore,
    view: memoryview,
    chunk_id: str,
    blocks: tuple[str, ...],
    codec: Codec,
    settings: UploadSettings,
) -> ChunkRef:
    """PUT one chunk under its id and codec (raw if that codec would barely shrink it); the
    reference to it, sizes exact."""
    stored, body = codecs.store_form(view, codec, level=settings.zstd_level)
    ref = ChunkRef(chunk_id, len(view), len(body), stored, blocks)
    store.put(ref.key, body)
    return ref


def _run_bounded(
    pool: cf.ThreadPoolExecutor,
    spans: list[T],
    fn: Callable[[T], ChunkRef],
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
