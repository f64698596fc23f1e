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

    Bytes not covered by an item (there should be none) are packed like a small item,
    so the chunks always cover the whole file exactly once.
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

    for span in spans:
        if span.offset < pos:
            raise ValueError(f"overlapping items at offset {span.offset}")
        if span.offset > pos:  # a gap: treat as a small filler
            add_small(pos, span.offset)
        if span.length > pack_size:
            flush(span.offset)
            start = span.offset
            while start < span.end:
                length = min(chunk_size, span.end - start)
                chunks.append(Span(start, length))
                start += length
        else:
            add_small(span.offset, span.end)
        pos = span.end
    if file_size > pos:
        add_small(pos, file_size)
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
    data: bytes | memoryview, digests: Sequence[str], first: int, block_size: int
) -> bool:
    """Whether ``data``, the bytes of a chunk from block ``first`` on (block-aligned), match
    the chunk's hex block digests, every block of it."""
    view = memoryview(data)
    return all(
        first + k // block_size < len(digests)
        and blake3.blake3(view[k : k + block_size]).hexdigest() == digests[first + k // block_size]
        for k in range(0, max(len(view), 1), block_size)
    )
