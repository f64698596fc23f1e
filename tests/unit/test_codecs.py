"""The chunk codecs (format/codecs.py): round trips, the byte-plane layout, bounded decoding,
refused names, and which codec a chunk gets."""

from __future__ import annotations

import os
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import zstandard

from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.errors import CheckpointError, CorruptCheckpointError
from trainer_sidecar.format import codecs
from trainer_sidecar.format.chunking import Span, plan_chunks
from trainer_sidecar.format.codecs import CodecError, Compression
from trainer_sidecar.format.manifest import (
    ChunkRef,
    Codec,
    Manifest,
    RankManifest,
    SaveIdentity,
    chunk_key,
    rank_manifest_key,
)
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.save.slots import StagedCheckpoint
from trainer_sidecar.save.uploader import StagedFile, UploadSettings, upload_rank
from trainer_sidecar.store.memory import MemoryStore

LENGTHS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1001, 1002, 1003, 4096, 65537, (1 << 20) + 3]


def sample(n: int, kind: str) -> bytes:
    rng = np.random.default_rng(n)
    if kind == "random":
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    if kind == "zeros":
        return bytes(n)
    width = {"fp32": 4, "fp16": 2, "fp64": 8}[kind]
    values = rng.normal(0, 0.02, n // width + 1)
    dtype = {4: np.float32, 2: np.float16, 8: np.float64}[width]
    return values.astype(dtype).tobytes()[:n]


@pytest.mark.parametrize("codec", list(Codec))
@pytest.mark.parametrize("kind", ["random", "zeros", "fp32", "fp16", "fp64"])
def test_every_codec_round_trips_every_length(codec: Codec, kind: str) -> None:
    # lengths that no element width divides included: the tail ends the last plane
    for n in LENGTHS:
        raw = sample(n, kind)
        stored = codecs.encode(raw, codec)
        assert codecs.decode(stored, codec, size=n) == raw, (codec, kind, n)
        assert codecs.decode(memoryview(stored), codec.value, size=n) == raw


def test_the_byte_plane_layout() -> None:
    # 2 whole 4-byte elements and one byte more: plane k is byte k of each element, the
    # tail ends the last plane
    raw = bytes([0x00, 0x01, 0x02, 0x03, 0x10, 0x11, 0x12, 0x13, 0x20])
    assert [p.tobytes() for p in codecs.planes(raw, 4)] == [
        bytes([0x00, 0x10]),
        bytes([0x01, 0x11]),
        bytes([0x02, 0x12]),
        bytes([0x03, 0x13, 0x20]),
    ]
    assert [p.tobytes() for p in codecs.planes(raw, 2)] == [
        bytes([0x00, 0x02, 0x10, 0x12]),
        bytes([0x01, 0x03, 0x11, 0x13, 0x20]),
    ]
    # the stored object is one zstd frame per plane: any zstd reader that reads across
    # frames gives the planes end to end
    stored = codecs.encode(raw, Codec.ZSTD_BP4)
    reader = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True)
    transformed = reader.read(100)
    assert transformed == b"".join(p.tobytes() for p in codecs.planes(raw, 4))
    assert codecs.unplanes(transformed, 4) == raw
    frames, rest = 0, stored
    while rest:
        obj = zstandard.ZstdDecompressor().decompressobj()
        obj.decompress(rest)
        rest, frames = obj.unused_data, frames + 1
    assert frames == 4


def test_byte_planes_compress_floats_better_than_plain_zstd() -> None:
    raw = sample(1 << 20, "fp32")
    plain = len(codecs.encode(raw, Codec.ZSTD))
    split = len(codecs.encode(raw, Codec.ZSTD_BP4))
    assert split < plain < len(raw)


def bomb(raw_size: int, *, content_size: bool) -> bytes:
    """A small zstd object that decompresses to ``raw_size`` zero bytes."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    if content_size:
        return cctx.compress(bytes(raw_size))
    writer = cctx.compressobj()
    out = b"".join(writer.compress(bytes(1 << 20)) for _ in range(raw_size >> 20))
    return out + writer.flush()


@pytest.mark.parametrize("content_size", [True, False])
@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.ZSTD_BP2, Codec.ZSTD_BP4])
def test_a_zip_bomb_is_refused_without_being_inflated(codec: Codec, content_size: bool) -> None:
    """256 MiB of zeros in a few KiB, stored as a 1 MiB chunk: refused after at most its raw
    size (plus one byte) is written, whatever the frame header claims. (zstandard's own
    ``decompress(max_output_size=...)`` allocates the header's content size first.)"""
    stored = bomb(256 << 20, content_size=content_size)
    assert len(stored) < 64 << 10
    tracemalloc.start()
    try:
        with pytest.raises(CodecError, match="more than its 1048576 raw bytes"):
            codecs.decode(stored, codec, size=1 << 20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak


def test_a_bomb_split_across_frames_is_refused_too() -> None:
    frame = bomb(1 << 20, content_size=True)
    stored = frame * 64  # 64 frames of 1 MiB each for a chunk of 2 MiB
    with pytest.raises(CodecError, match="more than"):
        codecs.decode(stored, Codec.ZSTD_BP4, size=2 << 20)


@pytest.mark.parametrize("codec", [Codec.ZSTD, Codec.ZSTD_BP2, Codec.ZSTD_BP4])
def test_objects_that_do_not_decode_to_their_chunk_are_refused(codec: Codec) -> None:
    raw = sample(100_003, "fp32")
    stored = codecs.encode(raw, codec)
    with pytest.raises(CodecError, match="not its"):
        codecs.decode(stored, codec, size=len(raw) + 1)  # short
    with pytest.raises(CodecError, match="more than"):
        codecs.decode(stored, codec, size=len(raw) - 1)  # long
    with pytest.raises(CodecError):
        codecs.decode(stored[: len(stored) // 2], codec, size=len(raw))  # truncated
    with pytest.raises(CodecError):
        codecs.decode(os.urandom(1000), codec, size=len(raw))  # not zstd
    with pytest.raises(CodecError):
        codecs.decode(stored + b"junk after the frames", codec, size=len(raw))


def test_raw_objects_must_be_exactly_the_chunk() -> None:
    assert codecs.decode(b"abc", "none", size=3) == b"abc"
    with pytest.raises(CodecError, match="is 3 bytes, not its 4"):
        codecs.decode(b"abc", "none", size=4)


@pytest.mark.parametrize("name", ["lz4", "ZSTD", "zstd-bp8", "zstd-bp3", "", "auto"])
def test_wrong_codec_names_are_refused(name: str) -> None:
    with pytest.raises(CodecError, match=f"unknown codec {name!r}"):
        codecs.encode(b"x", name)
    with pytest.raises(CodecError, match="unknown codec"):
        codecs.decode(b"x", name, size=1)
    with pytest.raises(ValueError):
        chunk_key("ab" * 32, name)  # never a guessed key for gc to mark


def test_stored_keys_name_the_codec() -> None:
    cid = "ab" * 32
    assert {c.value: ChunkRef(cid, 1, 1, c, ("cd" * 32,)).key for c in Codec} == {
        "none": f"chunks/ab/{cid}",
        "zstd": f"chunks/ab/{cid}.zst",
        "zstd-bp2": f"chunks/ab/{cid}.bp2.zst",
        "zstd-bp4": f"chunks/ab/{cid}.bp4.zst",
    }


def test_a_chunk_that_would_barely_shrink_is_stored_raw() -> None:
    noise = memoryview(sample(1 << 20, "random"))
    assert codecs.store_form(noise, Codec.ZSTD_BP4) == (Codec.NONE, noise)
    floats = memoryview(sample(1 << 20, "fp32"))
    codec, body = codecs.store_form(floats, Codec.ZSTD_BP4)
    assert codec is Codec.ZSTD_BP4 and len(body) < len(floats) * 0.9
    assert codecs.store_form(floats, Codec.NONE) == (Codec.NONE, floats)


# --------------------------------------------------------------------------- the choice

KB = 1024


def test_auto_splits_chunks_of_one_float_dtype_only() -> None:
    items = [
        Span(0, 40 * KB, "float32"),  # large: cut into 16 KiB pieces from its own start
        Span(40 * KB, 2 * KB, "float32"),  # small ones, packed: a pack of fp32 alone
        Span(42 * KB, 2 * KB, "float32"),
        Span(44 * KB, 4 * KB, "float32"),
        Span(48 * KB, 6, "bfloat16"),  # a pack of bf16 and fp32: mixed
        Span(48 * KB + 6, 4 * KB, "float32"),
        Span(52 * KB + 6, 20 * KB, "bfloat16"),
        Span(72 * KB + 6, 20 * KB, "int64"),
        Span(92 * KB + 6, 3 * KB, "bytes"),
    ]
    chunks = plan_chunks(items, file_size=95 * KB + 6, chunk_size=16 * KB, pack_size=8 * KB)
    kinds = codecs.chunk_dtypes(items, chunks)
    got = [
        (c.offset, c.length, codecs.choose("auto", k).value)
        for c, k in zip(chunks, kinds, strict=True)
    ]
    assert got == [
        (0, 16 * KB, "zstd-bp4"),
        (16 * KB, 16 * KB, "zstd-bp4"),
        (32 * KB, 8 * KB, "zstd-bp4"),
        (40 * KB, 8 * KB, "zstd-bp4"),
        (48 * KB, 4 * KB + 6, "zstd"),
        (52 * KB + 6, 16 * KB, "zstd-bp2"),
        (68 * KB + 6, 4 * KB, "zstd-bp2"),
        (72 * KB + 6, 16 * KB, "zstd"),
        (88 * KB + 6, 4 * KB, "zstd"),
        (92 * KB + 6, 3 * KB, "zstd"),
    ]
    assert all(codecs.choose("none", k) is Codec.NONE for k in kinds)
    assert all(codecs.choose("zstd", k) is Codec.ZSTD for k in kinds)


def test_chunks_not_on_element_boundaries_are_not_split() -> None:
    # a 6-byte bf16 item then fp32 ones, all in one pack: the fp32 items start at chunk
    # offset 6, off their 4-byte boundaries
    items = [Span(0, 6, "bfloat16"), Span(6, 8, "float32"), Span(14, 8, "float32")]
    (chunk,) = plan_chunks(items, file_size=22, chunk_size=4096, pack_size=4096)
    assert codecs.chunk_dtypes(items, [chunk]) == [("bfloat16", "")]
    # a piece of a fp32 item that starts mid-element (a chunk plan not from plan_chunks)
    assert codecs.chunk_dtypes([Span(0, 64, "float32")], [Span(2, 62)]) == [("",)]
    # bytes no item covers, and items of unknown dtype
    assert codecs.chunk_dtypes([Span(8, 8, "float32")], [Span(0, 16)]) == [("", "float32")]
    assert codecs.chunk_dtypes([Span(0, 8)], [Span(0, 8)]) == [("",)]
    assert codecs.chunk_dtypes([], [Span(0, 100)]) == [("",)]
    for kinds in (("bfloat16", ""), ("",), ("", "float32")):
        assert codecs.choose("auto", kinds) is Codec.ZSTD


def test_ready_json_carries_dtypes_and_reads_slots_without_them() -> None:
    from trainer_sidecar.format.manifest import Mode
    from trainer_sidecar.format.policy import SavePlan

    plan = SavePlan(3, Mode.FULL, None, 3, 0, None, SaveIdentity.new("1"))
    tensors = (Span(0, 8, "float32"), Span(8, 4, "bfloat16"))
    staged = StagedCheckpoint(
        step=3,
        rank=0,
        world_size=1,
        plan=plan,
        files=(("__0_0.distcp", tensors), (".metadata", ())),
        staged_at=1.0,
        stage_seconds=0.1,
    )
    again = StagedCheckpoint.from_json(staged.to_json())
    assert again.files == staged.files
    old = staged.to_json().replace(', "float32"]', "]").replace(', "bfloat16"]', "]")
    assert StagedCheckpoint.from_json(old).files[0][1] == (Span(0, 8), Span(8, 4))


# --------------------------------------------------------------------------- the setting


def test_the_compression_setting() -> None:
    for value in Compression:
        assert CheckpointConfig(uri="file:///tmp/x", compression=value).compression == value
    cfg = CheckpointConfig.from_env(
        {"CTJ_CHECKPOINT_URI": "s3://b/p", "CTJ_CHECKPOINT_COMPRESSION": "auto"}
    )
    assert cfg.compression is Compression.AUTO
    for bad in ("zstd-bp4", "lz4", "Auto"):
        with pytest.raises(CheckpointError) as info:
            CheckpointConfig(uri="file:///tmp/x", compression=bad)  # type: ignore[arg-type]
        assert str(info.value) == (
            f"checkpoint config: compression is {bad!r}: use one of none, zstd, auto"
        )


# --------------------------------------------------------------------------- upload, read


def upload_and_read(tmp_path: Path, compression: str) -> tuple[MemoryStore, Manifest, bytes]:
    """A staged file of a large fp32 tensor, a bf16 one and small values, uploaded under
    ``compression`` into memory; the manifest of it and the file's bytes."""
    f32 = sample(40 * KB, "fp32")
    f16 = sample(20 * KB + 2, "fp16")
    values = b"pickled values, repeated " * 40
    data = f32 + f16 + values
    path = tmp_path / "__0_0.distcp"
    path.write_bytes(data)
    items = (
        Span(0, len(f32), "float32"),
        Span(len(f32), len(f16), "bfloat16"),
        Span(len(f32) + len(f16), len(values), "bytes"),
    )
    store = MemoryStore()
    settings = UploadSettings(chunk_size=16 * KB, block_size=4 * KB, compression=compression)
    part = upload_rank(
        store,
        step=1,
        rank=0,
        save=SaveIdentity.new("1"),
        world_size=1,
        files=[StagedFile("__0_0.distcp", str(path), items)],
        reference={},
        settings=settings,  # type: ignore[arg-type]
    )
    manifest = Manifest(
        step=1,
        mode="full",
        parent_step=None,
        base_step=1,
        since_full=0,
        world_size=1,
        block_size=4 * KB,
        # the chunk lists the upload stored in its rank manifest (format version 3)
        files=RankManifest.from_bytes(store.get(rank_manifest_key(part.manifest))).files,
        logical_bytes=len(data),
        uploaded_bytes=part.uploaded_bytes,
        deduplicated_bytes=0,
        created=0.0,
    )
    return store, manifest, data


def test_an_auto_upload_reads_back_in_any_range(tmp_path: Path) -> None:
    store, manifest, data = upload_and_read(tmp_path, "auto")
    chunks = manifest.files["__0_0.distcp"].chunks
    assert [c.codec for c in chunks] == ["zstd-bp4"] * 3 + ["zstd-bp2"] * 2 + ["zstd"]
    for c in chunks:
        assert len(store.get(c.key)) == c.stored_size < c.size
    reader = ChunkReader(store, manifest)
    assert reader.read_file("__0_0.distcp") == data
    ranges = [(0, 1), (5, 16 * KB + 3), (40 * KB - 1, 60 * KB + 5), (len(data) - 7, len(data))]
    got = reader.read_ranges([("__0_0.distcp", a, b) for a, b in ranges])
    assert got == [data[a:b] for a, b in ranges]


def test_a_bomb_in_place_of_a_chunk_makes_the_checkpoint_corrupt(tmp_path: Path) -> None:
    store, manifest, _ = upload_and_read(tmp_path, "auto")
    first = manifest.files["__0_0.distcp"].chunks[0]
    store.put(first.key, bomb(64 << 20, content_size=True))
    with pytest.raises(CorruptCheckpointError, match="decompresses to more than its 16384"):
        ChunkReader(store, manifest).fetch_verified(first, 0, first.size)
    # decoded to the right length but other bytes: the block digests catch it
    store.put(first.key, codecs.encode(bytes(first.size), first.codec))
    with pytest.raises(CorruptCheckpointError, match="fails its hash check"):
        ChunkReader(store, manifest).fetch_verified(first, 0, first.size)
