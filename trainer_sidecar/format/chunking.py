"""How a staged rank file is cut into content-addressed chunks, and how chunks are hashed.

Pure functions, no I/O. Two rules make deltas cheap and reads verifiable:

* Chunk boundaries follow the file's item (tensor) layout: every item larger
  than ``pack_size`` starts a new chunk and is cut into ``chunk_size`` pieces
  from its own start; smaller items are packed together up to ``pack_size``.
  An unchanged tensor therefore gives byte-identical chunks whatever changed
  around it, and a changed small tensor costs at most one pack of upload.
* A chunk's id is BLAKE3 over the BLAKE3 digests of its fixed-size blocks (a
  two-level hash tree). A ranged read fetches whole blocks and checks each
  against the manifest, so resharding loads verify what they read without
  fetching whole chunks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import blake3

MIB = 1 << 20
DEFAULT_BLOCK_SIZE = 1 * MIB
DEFAULT_CHUNK_SIZE = 8 * MIB
DEFAULT_PACK_SIZE = 256 * 1024

# The format's limits (docs/format.md, "Limits: what a reader trusts"). A writer never
# cuts a chunk larger than MAX_CHUNK_SIZE (``chunk_size`` is at most that), and its block
# size is a power of two in [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]. A reader refuses any record
# outside them before it allocates anything by it: a chunk's raw size is the most memory
# one chunk may cost a reader, whatever a record claims.
MAX_CHUNK_SIZE = 64 * MIB
MIN_BLOCK_SIZE = 4096
MAX_BLOCK_SIZE = MAX_CHUNK_SIZE


def max_stored_size(raw_size: int) -> int:
    """The largest stored object a chunk of ``raw_size`` raw bytes can have under any codec:
    zstd's worst-case expansion of incompressible bytes (``ZSTD_compressBound``: 1/256 plus
    a frame's overhead, for each of up to 4 byte-plane frames). ctj before its byte-plane
    codecs stored zstd objects whatever their size, so one may exceed its raw size."""
    return raw_size + (raw_size >> 8) + 1024


def block_size_problem(block_size: int) -> str | None:
    """Why ``block_size`` is not one a writer uses (a power of two in
    [MIN_BLOCK_SIZE, MAX_BLOCK_SIZE]); None when it is."""
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        return f"is not a power of two from {MIN_BLOCK_SIZE} to {MAX_BLOCK_SIZE} bytes"
    return None


def chunk_size_problem(size: int, stored_size: int) -> str | None:
    """Why a chunk record's raw and stored sizes are outside the format's limits (raw at
    most MAX_CHUNK_SIZE, stored at most ``max_stored_size`` of it); None when inside."""
    if not 0 <= size <= MAX_CHUNK_SIZE:
        return f"claims {size} raw bytes, outside 0..{MAX_CHUNK_SIZE} (the maximum chunk size)"
    if not 0 <= stored_size <= max_stored_size(size):
        return (
            f"claims {stored_size} stored bytes, outside 0..{max_stored_size(size)} "
            f"(what a chunk of {size} raw bytes can be stored in)"
        )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    offset: int
    length: int
    dtype: str = ""  # an item's element type ("float32", "bfloat16", "bytes"); "" unknown

    @property
    def end(self) -> int:
        return self.offset + self.length


def plan_chunks(
    items: Sequence[Span], *, file_size: int, chunk_size: int, pack_size: int = DEFAULT_PACK_SIZE
) -> list[Span]:
    """Chunk boundaries for a file whose items are laid end to end from offset 0.

    Bytes not covered by an item (a file with no items, such as ``.metadata``) are cut
    like an item of their own, so the chunks always cover the whole file exactly once,
    and no chunk is ever larger than ``chunk_size`` (at most MAX_CHUNK_SIZE: what a
    reader accepts).
    """
    if not 0 < pack_size <= chunk_size:
        raise ValueError("pack_size must be positive and at most chunk_size")
    spans = sorted((s for s in items if s.length > 0), key=lambda s: s.offset)
    chunks: list[Span] = []
    pack_start: int | None = None
    pos = 0

    def flush(upto: int) -> None:
        nonlocal pack_start
        if pack_start is not None and upto > pack_start:
            chunks.append(Span(pack_start, upto - pack_start))
        pack_start = None

    def add_small(start: int, end: int) -> None:
        nonlocal pack_start
        if pack_start is not None and end - pack_start > pack_size:
            flush(start)
        if pack_start is None:
            pack_start = start

    def add(start: int, end: int) -> None:
        """An item, or bytes no item covers (a file without items: ``.metadata``)."""
        if end - start <= pack_size:
            add_small(start, end)
            return
        flush(start)
        while start < end:
            length = min(chunk_size, end - start)
            chunks.append(Span(start, length))
            start += length

    for span in spans:
        if span.offset < pos:
            raise ValueError(f"overlapping items at offset {span.offset}")
        if span.offset > pos:  # a gap: cut like an item
            add(pos, span.offset)
        add(span.offset, span.end)
        pos = span.end
    if file_size > pos:
        add(pos, file_size)
        pos = file_size
    flush(pos)
    return chunks


def block_digests(data: memoryview | bytes, block_size: int) -> list[bytes]:
    view = memoryview(data)
    return [
        blake3.blake3(view[i : i + block_size]).digest()
        for i in range(0, max(len(view), 1), block_size)
    ]


def chunk_id(digests: Sequence[bytes]) -> str:
    return blake3.blake3(b"".join(digests)).hexdigest()


def hash_chunk(data: memoryview | bytes, block_size: int) -> tuple[str, list[str]]:
    """(chunk id, hex block digests) of one chunk's raw bytes."""
    digests = block_digests(data, block_size)
    return chunk_id(digests), [d.hex() for d in digests]


def blocks_for_range(start: int, end: int, size: int, block_size: int) -> tuple[int, int]:
    """The block-aligned byte range [a, b) of a chunk of ``size`` bytes covering [start, end)."""
    if not 0 <= start < end <= size:
        raise ValueError(f"range [{start}, {end}) outside chunk of {size} bytes")
    a = (start // block_size) * block_size
    b = min(size, -(-end // block_size) * block_size)
    return a, b


def blocks_match(
    data: bytes | memoryview | Sequence[memoryview],
    digests: Sequence[str],
    first: int,
    block_size: int,
) -> bool:
    """Whether ``data``, the bytes of a chunk from block ``first`` on (block-aligned), match
    the chunk's hex block digests, every block of it. ``data`` may be several buffers laid
    end to end (a read scattered into its targets): a block that straddles two is hashed
    across them, copying nothing."""
    parts = [data] if isinstance(data, bytes | memoryview) else data
    k, hasher, filled = first, blake3.blake3(), 0

    def block_ends() -> bool:
        nonlocal k, hasher, filled
        ok = k < len(digests) and hasher.hexdigest() == digests[k]
        k, hasher, filled = k + 1, blake3.blake3(), 0
        return ok

    for part in parts:
        view = memoryview(part).cast("B")
        pos = 0
        while pos < len(view):
            take = min(block_size - filled, len(view) - pos)
            hasher.update(view[pos : pos + take])
            filled, pos = filled + take, pos + take
            if filled == block_size and not block_ends():
                return False
    # the last, short block; or the one (empty) block of an empty chunk
    return not (filled or k == first) or block_ends()
