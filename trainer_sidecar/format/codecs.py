"""How a chunk's raw bytes are stored: the codecs, and which one a chunk gets.

Pure functions, no torch (the sidecar never imports it). A chunk's id and block
digests are always over its **raw** bytes, whatever the codec, so deduplication
works across codecs and every byte a reader returns is verified after decoding.

Codecs (the stored object's key suffix in parentheses; docs/format.md):

* ``none`` (no suffix): the raw bytes. The only codec whose byte ranges are raw byte
  ranges, so the only one a resharding load reads in parts.
* ``zstd`` (``.zst``): one zstd frame of the raw bytes.
* ``zstd-bp2`` / ``zstd-bp4`` (``.bp2.zst`` / ``.bp4.zst``): the raw bytes split into
  byte planes for elements of 2 (bf16, fp16) or 4 (fp32) bytes, each plane its own zstd
  frame. Byte k of every element goes together, so the exponent bytes (which repeat a
  few values) compress and the mantissa bytes (near random) are left to zstd's raw
  blocks: that split is where lossless float compression gets its gains
  (bench/bench_compression.py measures it).

Decoding is bounded: it never produces more than the chunk's raw size (as the
manifest states it, at most MAX_CHUNK_SIZE), however the stored object was made, so a
hostile object (a zstd "bomb" whose frame header claims gigabytes) is refused after at
most that many bytes, never allocated; and its output grows only by what actually
decodes, so a record claiming a raw size its object does not hold (a few bytes that
"are" 64 MiB) costs what the object decodes to, not the claim.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

import numpy as np
import zstandard

from .chunking import MAX_CHUNK_SIZE, Span
from .manifest import Codec

DEFAULT_ZSTD_LEVEL = 1  # measured (docs/benchmarks.md, Compression): higher levels don't pay

WIDTH = {Codec.ZSTD_BP2: 2, Codec.ZSTD_BP4: 4}  # element width of each byte-plane codec

# What ``compression="auto"`` stores a chunk of one dtype with (a chunk whose items are
# all of that dtype, element-aligned); any other chunk (packs of mixed dtypes, integer
# tensors, non-tensor values, .metadata) gets plain zstd. Chosen by measured ratio vs
# CPU cost on a trained model's weights and AdamW state (bench/bench_compression.py).
AUTO: dict[str, Codec] = {
    "float32": Codec.ZSTD_BP4,
    "bfloat16": Codec.ZSTD_BP2,
    "float16": Codec.ZSTD_BP2,
}
AUTO_OTHER = Codec.ZSTD

# A chunk is stored compressed only if that saves at least 1/MIN_SAVING_DIVISOR of it:
# compressed chunks are read whole, so a chunk that barely shrinks is better raw.
MIN_SAVING_DIVISOR = 32


class Compression(enum.StrEnum):
    """The ``compression`` setting: how a save chooses each chunk's codec."""

    NONE = "none"  # every chunk raw
    ZSTD = "zstd"  # every chunk zstd
    AUTO = "auto"  # per dtype: byte planes + zstd for floats, zstd for the rest (AUTO)


class CodecError(ValueError):
    """A stored object that does not decode to its chunk (or a codec not known)."""


def codec_of(name: str) -> Codec:
    try:
        return Codec(name)
    except ValueError:
        known = ", ".join(c.value for c in Codec)
        raise CodecError(f"names an unknown codec {name!r} (known: {known})") from None


def is_ranged(codec: str) -> bool:
    """Whether a byte range of the stored object is that range of the raw chunk."""
    return codec_of(codec) is Codec.NONE


# --------------------------------------------------------------------------- encode

_LOCAL = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    """One compressor per thread and level (they are not thread-safe, and cheap to reuse)."""
    cache: dict[int, zstandard.ZstdCompressor] | None = getattr(_LOCAL, "cctx", None)
    if cache is None:
        cache = _LOCAL.cctx = {}
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cache[level]


def planes(data: memoryview | bytes, width: int) -> list[np.ndarray]:
    """The byte-plane split of ``data`` for elements of ``width`` bytes: plane k holds
    byte k of every whole element, in order; the bytes after the last whole element
    (``len(data) % width``) end the last plane. Their concatenation is a permutation of
    ``data`` of the same length."""
    raw = np.frombuffer(data, dtype=np.uint8)
    m = len(raw) // width
    grid = raw[: m * width].reshape(m, width)
    out = [np.ascontiguousarray(grid[:, k]) for k in range(width)]
    if len(raw) % width:
        out[-1] = np.concatenate([out[-1], raw[m * width :]])
    return out


def unplanes(data: bytes | bytearray | memoryview, width: int) -> bytes:
    """The inverse of ``planes`` over their concatenation."""
    flat = np.frombuffer(data, dtype=np.uint8)
    n = len(flat)
    m = n // width
    out = np.empty(n, dtype=np.uint8)
    for k in range(width):
        out[k : m * width : width] = flat[k * m : (k + 1) * m]
    out[m * width :] = flat[width * m :]
    return out.tobytes()


def encode(data: memoryview | bytes, codec: str, *, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """The stored object for a chunk's raw bytes under ``codec``."""
    c = codec_of(codec)
    if c is Codec.NONE:
        return bytes(data)
    cctx = _compressor(level)
    if c is Codec.ZSTD:
        return cctx.compress(data)
    return b"".join(cctx.compress(plane.data) for plane in planes(data, WIDTH[c]))


def store_form(
    data: memoryview, codec: str, *, level: int = DEFAULT_ZSTD_LEVEL
) -> tuple[Codec, bytes | memoryview]:
    """(codec, body) to store a chunk with: ``codec``'s encoding, or the raw bytes (codec
    none) when it would save less than 1/MIN_SAVING_DIVISOR of the chunk."""
    c = codec_of(codec)
    if c is Codec.NONE:
        return c, data
    body = encode(data, c, level=level)
    if len(data) - len(body) < len(data) // MIN_SAVING_DIVISOR or len(body) >= len(data):
        return Codec.NONE, data
    return c, body


# --------------------------------------------------------------------------- decode


DECODE_STEP = 1 << 20  # bytes decoded at a time: the output grows by what decodes, never by a claim


def _unzstd(stored: bytes | memoryview, size: int) -> bytes:
    """Every zstd frame of ``stored``, in order, decompressed: exactly ``size`` bytes or a
    CodecError. Never decodes more than ``size + 1`` bytes, whatever the frames claim, and
    never allocates more than it decoded (plus one DECODE_STEP) and their join: a claimed
    ``size`` the object does not hold costs nothing."""
    pieces: list[bytes] = []
    got = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
        with reader:
            while got <= size:
                piece = reader.read(min(DECODE_STEP, size + 1 - got))
                if not piece:
                    break
                pieces.append(piece)
                got += len(piece)
    except zstandard.ZstdError as exc:
        raise CodecError(f"does not decompress ({exc})") from None
    if got > size:
        raise CodecError(f"decompresses to more than its {size} raw bytes")
    if got < size:
        raise CodecError(f"decompresses to {got} bytes, not its {size} raw bytes")
    return pieces[0] if len(pieces) == 1 else b"".join(pieces)


def decode(stored: bytes | memoryview, codec: str, *, size: int) -> bytes:
    """A chunk's raw bytes (``size`` of them, the manifest's raw size) from its stored
    object; CodecError when the object does not decode to exactly that many bytes, or
    ``size`` is outside the format's limits. The caller verifies them against the chunk's
    block digests. Memory: the object, what it decodes to (at most ``size + 1`` bytes),
    and one copy of the result; never ``size`` bytes the object does not hold."""
    c = codec_of(codec)
    if not 0 <= size <= MAX_CHUNK_SIZE:
        raise CodecError(f"raw size {size} is outside 0..{MAX_CHUNK_SIZE} (the maximum chunk size)")
    if c is Codec.NONE:
        if len(stored) != size:
            raise CodecError(f"is {len(stored)} bytes, not its {size} raw bytes")
        return bytes(stored)
    raw = _unzstd(stored, size)
    return raw if c is Codec.ZSTD else unplanes(raw, WIDTH[c])


# --------------------------------------------------------------------------- choice


def choose(compression: str, dtypes: Sequence[str]) -> Codec:
    """The codec for one chunk under the ``compression`` setting, given what the chunk
    holds (``chunk_dtypes``): with ``auto``, a chunk of one float dtype that has a
    byte-plane codec gets it, every other chunk plain zstd."""
    setting = Compression(compression)
    if setting is Compression.NONE:
        return Codec.NONE
    if setting is Compression.ZSTD:
        return Codec.ZSTD
    kinds = set(dtypes)
    if len(kinds) == 1:
        return AUTO.get(kinds.pop(), AUTO_OTHER)
    return AUTO_OTHER


def chunk_dtypes(items: Sequence[Span], chunks: Sequence[Span]) -> list[tuple[str, ...]]:
    """For each chunk (in file order), the dtypes of the items it holds: an item's
    ``dtype``, or "" for bytes no item covers, for an item of unknown dtype, and for an
    item whose part in the chunk does not start on an element boundary (of the chunk and
    of the item) of the byte planes ``auto`` would split it into. So a chunk of one
    dtype is always element-aligned: its planes are whole bytes of whole elements."""
    spans = sorted((s for s in items if s.length > 0), key=lambda s: s.offset)
    out: list[tuple[str, ...]] = []
    i = 0
    for chunk in chunks:
        while i < len(spans) and spans[i].end <= chunk.offset:
            i += 1
        kinds: list[str] = []
        pos = chunk.offset
        j = i
        while j < len(spans) and spans[j].offset < chunk.end:
            item = spans[j]
            start = max(item.offset, chunk.offset)
            if start > pos:
                kinds.append("")  # bytes no item covers
            width = WIDTH.get(AUTO.get(item.dtype, AUTO_OTHER), 1)
            aligned = (start - item.offset) % width == 0 and (start - chunk.offset) % width == 0
            kinds.append(item.dtype if aligned else "")
            pos = min(item.end, chunk.end)
            j += 1
        if pos < chunk.end or not kinds:
            kinds.append("")
        out.append(tuple(dict.fromkeys(kinds)))
    return out
