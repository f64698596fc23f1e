"""Read byte ranges of a checkpoint's files from their chunks, verifying every block.

A read of [start, end) of a file becomes, per overlapping chunk, one GET of the
block-aligned range that covers it (the whole object when compressed), checked
block by block against the manifest's BLAKE3 digests. Nothing unverified is
ever returned. With tiers (tiers.py), the node's cache and the peers' are read
first, checked by the same digests.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
import dataclasses
import threading
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from ..errors import CorruptCheckpointError, ObjectNotFound
from ..format import codecs
from ..format.chunking import blocks_for_range, blocks_match, max_stored_size
from ..format.manifest import ChunkRef, FileEntry, Manifest
from ..store.base import ObjectStore, read_bounded, read_into
from .tiers import ChunkTiers, Tier

MAX_SCRATCH = 2 << 20
"""The most bytes a read into place may set aside for the bytes between and around the
ranges it serves (a range's first and last blocks, read whole to be hashed: two 1 MiB
blocks for a range that starts and ends mid-block)."""


@dataclasses.dataclass
class ReadStats:
    requests: int = 0
    bytes_fetched: int = 0
    by_tier: dict[str, int] = dataclasses.field(default_factory=dict)  # bytes per tier


class FileIndex:
    """Offsets of a file's chunks, for finding which chunks a byte range touches."""

    def __init__(self, entry: FileEntry) -> None:
        self.entry = entry
        self.starts: list[int] = []
        pos = 0
        for c in entry.chunks:
            self.starts.append(pos)
            pos += c.size

    def pieces(self, start: int, end: int) -> list[tuple[int, int, int]]:
        """(chunk index, start within chunk, end within chunk) covering [start, end)."""
        if not 0 <= start <= end <= self.entry.size:
            raise ValueError(f"range [{start}, {end}) outside file of {self.entry.size} bytes")
        out = []
        i = max(0, bisect.bisect_right(self.starts, start) - 1)
        while start < end and i < len(self.starts):
            c_start = self.starts[i]
            c_end = c_start + self.entry.chunks[i].size
            if c_end > start:
                out.append((i, start - c_start, min(end, c_end) - c_start))
                start = min(end, c_end)
            i += 1
        return out


class _Indexes(dict[str, FileIndex]):
    """Each file's FileIndex, built when a read first touches it: a version 3 manifest then
    fetches only the rank manifests of the files read."""

    def __init__(self, files: Mapping[str, FileEntry]) -> None:
        super().__init__()
        self.files = files

    def __missing__(self, name: str) -> FileIndex:
        index = self[name] = FileIndex(self.files[name])
        return index


class ChunkReader:
    def __init__(
        self,
        store: ObjectStore,
        manifest: Manifest,
        *,
        parallelism: int = 8,
        tiers: ChunkTiers | None = None,
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.parallelism = parallelism
        self.tiers = tiers
        self.indexes = _Indexes(manifest.files)
        self.stats = ReadStats()
        self._stats_lock = threading.Lock()

    def fetch_verified(self, chunk: ChunkRef, start: int, end: int) -> memoryview:
        """Bytes [start, end) of one chunk, verified: from the nearest tier that holds
        them (node cache, peers), else by block-aligned ranged GET from the store. A
        read-only view of what was fetched (slicing copies nothing)."""
        bs = self.manifest.block_size
        a, b = blocks_for_range(start, end, chunk.size, bs) if chunk.size else (0, 0)
        data = self._from_tiers(chunk, a, b)
        if data is None:
            data, a = self._from_store(chunk, start, end)
            self._keep(chunk, a, data)
        return memoryview(data)[start - a : end - a]

    def fetch_into(self, chunk: ChunkRef, a: int, b: int, into: Sequence[memoryview]) -> None:
        """``fetch_verified`` of block-aligned bytes [a, b), written into the buffers
        ``into`` (of ``b - a`` bytes in all) one after the other. From the store, an
        uncompressed chunk's GET goes straight into them and is verified there, a block
        that straddles two buffers hashed across both: no buffer of the reader's own, no
        copy. A read that fails its check raises, having written unverified bytes only
        into the buffers of a load that fails."""
        data = self._from_tiers(chunk, a, b)
        if data is None and codecs.is_ranged(chunk.codec):
            self._into_from_store(chunk, a, b, into)
            if self.tiers is not None and a == 0 and b == chunk.size:
                self._keep(chunk, 0, into[0] if len(into) == 1 else b"".join(into))
            return
        src: bytes | memoryview
        if data is None:
            whole, first = self._from_store(chunk, a, b)
            self._keep(chunk, first, whole)
            src = memoryview(whole)[a - first : b - first]
        else:
            src = data
        pos = 0
        for view in into:
            np.frombuffer(view, np.uint8)[:] = np.frombuffer(src, np.uint8, view.nbytes, pos)
            pos += view.nbytes

    def _from_tiers(self, chunk: ChunkRef, a: int, b: int) -> bytes | None:
        """Verified bytes [a, b) (block-aligned) from the nearest tier that has them."""
        if self.tiers is None:
            return None
        for tier, data in self.tiers.candidates(chunk, a, b):
            if self._verified(chunk, data, a):
                self._count(len(data), tier)
                return data
            self.tiers.reject(tier, chunk)
        return None

    def _keep(self, chunk: ChunkRef, a: int, data: bytes | memoryview) -> None:
        """A whole chunk read from the store: the node's tier holds it from now on."""
        if self.tiers is not None and a == 0 and len(data) == chunk.size:
            self.tiers.keep(chunk, data)

    def _into_from_store(self, chunk: ChunkRef, a: int, b: int, into: Sequence[memoryview]) -> None:
        """Block-aligned bytes [a, b) of an uncompressed chunk, GET from the store into
        ``into`` and verified there; the same bounds and checks as ``_from_store``."""
        step = self.manifest.step
        whole = a == 0 and b == chunk.size  # one byte more tells a larger object from it
        try:
            n = read_into(self.store, chunk.key, into, byte_range=(a, b + 1 if whole else b))
        except ObjectNotFound:
            raise CorruptCheckpointError(step, chunk.id, "is missing") from None
        self._count(min(n, b - a), Tier.STORE)  # a larger object is not read
        self._check(chunk, into, n, a, b)

    def _from_store(self, chunk: ChunkRef, start: int, end: int) -> tuple[bytes, int]:
        """(verified raw bytes [a, b) covering [start, end), a) read from the store. Never
        more than the chunk's stored form can be (``max_stored_size`` of its raw size, at
        most the format's maximum chunk size): an object larger than its record says is
        refused after that many bytes, and a record claiming more than its object holds
        costs what the object holds."""
        bs = self.manifest.block_size
        step = self.manifest.step
        try:
            if not codecs.is_ranged(chunk.codec):  # compressed: read whole, decoded bounded
                a, b = 0, chunk.size
                most = max_stored_size(chunk.size)
                raw = read_bounded(self.store, chunk.key, most)
                self._count(len(raw), Tier.STORE)
                if len(raw) > most:
                    raise CorruptCheckpointError(
                        step,
                        chunk.id,
                        f"is more than {most} bytes, the most {chunk.size} raw bytes are stored in",
                    )
                data = codecs.decode(raw, chunk.codec, size=chunk.size)
            else:
                a, b = blocks_for_range(start, end, chunk.size, bs) if chunk.size else (0, 0)
                whole = a == 0 and b == chunk.size
                if whole:  # one byte more than its size tells a larger object from it
                    data = read_bounded(self.store, chunk.key, chunk.size)
                else:
                    data = self.store.get(chunk.key, byte_range=(a, b))
                self._count(len(data), Tier.STORE)
        except ObjectNotFound:
            raise CorruptCheckpointError(step, chunk.id, "is missing") from None
        except codecs.CodecError as exc:
            raise CorruptCheckpointError(step, chunk.id, str(exc)) from None
        self._check(chunk, data, len(data), a, b)
        return data, a

    def _check(
        self, chunk: ChunkRef, data: bytes | Sequence[memoryview], got: int, a: int, b: int
    ) -> None:
        """Refuse the ``got`` bytes a store returned for chunk bytes [a, b) (block-aligned),
        held in ``data``, unless they are exactly those bytes, every block matching."""
        step = self.manifest.step
        if got > b - a:
            raise CorruptCheckpointError(step, chunk.id, f"is larger than its {chunk.size} bytes")
        if got < b - a:
            raise CorruptCheckpointError(step, chunk.id, "is truncated")
        if not self._verified(chunk, data, a):
            raise CorruptCheckpointError(step, chunk.id, "fails its hash check")

    def _verified(
        self, chunk: ChunkRef, data: bytes | memoryview | Sequence[memoryview], a: int
    ) -> bool:
        """Every block of ``data`` (chunk bytes from offset ``a``, block-aligned) matches."""
        bs = self.manifest.block_size
        return blocks_match(data, chunk.blocks, a // bs, bs)

    def _count(self, n: int, tier: str) -> None:
        with self._stats_lock:
            self.stats.requests += 1
            self.stats.bytes_fetched += n
            self.stats.by_tier[tier] = self.stats.by_tier.get(tier, 0) + n

    def read_ranges(
        self,
        ranges: Sequence[tuple[str, int, int]],
        into: Sequence[memoryview | None] | None = None,
    ) -> list[memoryview]:
        """Many (file, start, end) ranges at once, each as a view of its bytes.

        Pieces that touch the same chunk are merged into as few block-aligned GETs
        as possible, and the GETs run in parallel. A range given a writable buffer in
        ``into`` (a flat byte view of exactly its size, such as a tensor's storage) is
        written there, and that buffer is its result: each fetch's thread copies its
        verified bytes into place as soon as it has them (numpy's copy, without the
        GIL), and the fetched bytes are dropped. Of the other ranges, one that lies in a
        single fetch is a read-only view of it (no copy); any other is gathered into a
        new buffer.
        """
        if into is not None and len(into) != len(ranges):
            raise ValueError(f"{len(into)} buffers for {len(ranges)} ranges")
        dsts = [None if into is None else into[n] for n in range(len(ranges))]
        for (_, start, end), dst in zip(ranges, dsts, strict=True):
            if dst is not None and dst.nbytes != end - start:
                raise ValueError(f"a buffer of {dst.nbytes} bytes for a range of {end - start}")
        bs = self.manifest.block_size
        pieces: list[tuple[int, ChunkRef, int, int]] = []
        wanted: dict[str, list[tuple[int, int]]] = {}
        chunks: dict[str, ChunkRef] = {}
        for n, (name, start, end) in enumerate(ranges):
            index = self.indexes[name]
            for i, s, e in index.pieces(start, end):
                chunk = index.entry.chunks[i]
                pieces.append((n, chunk, s, e))
                chunks[chunk.id] = chunk
                span = (
                    (0, chunk.size)
                    if not codecs.is_ranged(chunk.codec) or not chunk.size
                    else (blocks_for_range(s, e, chunk.size, bs))
                )
                wanted.setdefault(chunk.id, []).append(span)
        fetches = [(cid, a, b) for cid, spans in wanted.items() for a, b in _merge(spans)]
        fetched_in: dict[str, list[tuple[int, int, int]]] = {}  # chunk id: (a, b, fetch index)
        for k, (cid, a, b) in enumerate(fetches):
            fetched_in.setdefault(cid, []).append((a, b, k))
        # each piece goes straight into its range's buffer (by the fetch's thread) or is kept
        placed: list[list[tuple[npt.NDArray[np.uint8], int, int]]] = [[] for _ in fetches]
        kept: list[tuple[int, int, int, int]] = []  # (range, fetch index, lo, hi)
        arrays = [None if d is None else np.frombuffer(d.cast("B"), np.uint8) for d in dsts]
        filled = [0] * len(ranges)
        for n, chunk, s, e in pieces:
            a, _, k = next(f for f in fetched_in[chunk.id] if f[0] <= s and e <= f[1])
            array = arrays[n]
            if array is not None:
                placed[k].append((array[filled[n] : filled[n] + e - s], s - a, e - a))
            else:
                kept.append((n, k, s - a, e - a))
            filled[n] += e - s
        needed = {k for _, k, _, _ in kept}

        def fetch(k: int) -> memoryview | None:
            cid, a, b = fetches[k]
            direct = k not in needed and codecs.is_ranged(chunks[cid].codec)
            into = _laid_out(placed[k], b - a) if direct else None
            if into is not None:  # every byte to its place, scratch for the bytes between
                self.fetch_into(chunks[cid], a, b, into)
                return None
            data = self.fetch_verified(chunks[cid], a, b)
            if placed[k]:
                src = np.frombuffer(data, np.uint8)
                for dst, lo, hi in placed[k]:
                    dst[:] = src[lo:hi]
            return data if k in needed else None

        if self.tiers is not None:
            self.tiers.prepare(chunks.values())
        with cf.ThreadPoolExecutor(self.parallelism, thread_name_prefix="ctj-read") as pool:
            datas = list(pool.map(fetch, range(len(fetches))))
        parts: list[list[memoryview]] = [[] for _ in ranges]
        for n, k, lo, hi in kept:
            data = datas[k]
            assert data is not None
            parts[n].append(data[lo:hi])
        return [
            dst.cast("B") if dst is not None else _joined(p, end - start)
            for dst, p, (_, start, end) in zip(dsts, parts, ranges, strict=True)
        ]

    def read_file(self, name: str) -> bytes:
        return bytes(self.read_ranges([(name, 0, self.manifest.files[name].size)])[0])


def _laid_out(
    pieces: list[tuple[npt.NDArray[np.uint8], int, int]], size: int
) -> list[memoryview] | None:
    """Buffers covering a fetch's ``size`` bytes in order: each piece's place in its
    range's buffer (``(dst, lo, hi)``: bytes [lo, hi) of the fetch go to ``dst``), and a
    scratch buffer for each run of bytes no piece wants (the block hashes cover them). None
    where two pieces overlap, or the scratch would be more than ``MAX_SCRATCH``: it is
    allocated before the GET, and a record claiming bytes its object does not hold must
    cost no more than the object (the GET into a plain buffer then stops at its end)."""
    gaps: list[tuple[int, int]] = []  # (index in out, size)
    out: list[memoryview | None] = []
    pos = 0
    for dst, lo, hi in sorted(pieces, key=lambda p: p[1]):
        if lo < pos:
            return None
        if lo > pos:
            gaps.append((len(out), lo - pos))
            out.append(None)
        out.append(dst.data)
        pos = hi
    if pos < size:
        gaps.append((len(out), size - pos))
        out.append(None)
    if sum(n for _, n in gaps) > MAX_SCRATCH:
        return None
    for i, n in gaps:
        out[i] = memoryview(bytearray(n))
    return [v for v in out if v is not None]


def _joined(parts: list[memoryview], size: int) -> memoryview:
    """``parts`` laid end to end: a view of the only part, else a new buffer."""
    if len(parts) == 1:
        return parts[0]
    out = memoryview(bytearray(size))
    pos = 0
    for p in parts:
        out[pos : pos + p.nbytes] = p
        pos += p.nbytes
    return out


def _merge(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
