"""Every size and count a reader takes from the store is bounded before it is used
(docs/format.md, "Limits: what a reader trusts").

A record's claims (a chunk's raw and stored size, a block size, a world size, a pickle's
memo index, an object's length) are checked against the format's limits and against the
bytes of the object that makes them, before anything is allocated by them: a hostile
object costs about its own size, never what it claims, and is refused as a corrupt
checkpoint is. Each memory claim here is measured with tracemalloc.

New names are imported inside the tests that use them, so that against a ctj without
these bounds every test fails on its own assertion.
"""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import zstandard
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
)

from tests.conftest import traced_peak
from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.errors import CheckpointError, CorruptCheckpointError, UnsafeCheckpointError
from trainer_sidecar.format import codecs
from trainer_sidecar.format import manifest as fmt
from trainer_sidecar.format.chunking import hash_chunk
from trainer_sidecar.format.codecs import CodecError
from trainer_sidecar.format.manifest import (
    METADATA_FILE,
    ChunkRef,
    FileEntry,
    Manifest,
    RankManifest,
    RankPart,
    SaveIdentity,
    manifest_key,
)
from trainer_sidecar.load import checks
from trainer_sidecar.load.chunk_reader import ChunkReader
from trainer_sidecar.load.dcp_reader import read_checked_metadata
from trainer_sidecar.store import repository
from trainer_sidecar.store.local import LocalStore
from trainer_sidecar.store.memory import MemoryStore

MIB = 1 << 20
BS = MIB
SAVE = SaveIdentity("1", "aaaaaaaaaaaaaaaa")
DIGEST = "ab" * 32


def chunk_json(size: int, *, stored: int | None = None, codec: str = "none") -> list[Any]:
    blocks = max(1, -(-size // BS))
    return [DIGEST, size, size if stored is None else stored, codec, [DIGEST] * blocks]


def manifest_body(**changes: Any) -> dict[str, Any]:
    """A well-formed version 3 manifest of one rank (its rank manifest is not stored)."""
    body: dict[str, Any] = {
        "format": "ctj-checkpoint",
        "version": 3,
        "step": 2,
        "mode": "full",
        "parent_step": None,
        "base_step": 2,
        "since_full": 0,
        "world_size": 1,
        "block_size": BS,
        "logical_bytes": 4,
        "uploaded_bytes": 4,
        "deduplicated_bytes": 0,
        "created": 0.0,
        "save": SAVE.to_json(),
        "ranks": [{"rank": 0, "manifest": "0" * 64, "files": {"__0_0.distcp": 4}}],
    }
    body.update(changes)
    return body


def inline_body(**changes: Any) -> dict[str, Any]:
    """A version 2 manifest: the chunk lists inline."""
    body = manifest_body(files={"__0_0.distcp": {"size": 4, "chunks": [chunk_json(4)]}})
    del body["ranks"]
    body.update(changes)
    return body


def encoded(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# -- a chunk's raw and stored size ------------------------------------------------------


def test_the_maximum_chunk_size_is_what_a_writer_may_cut() -> None:
    from trainer_sidecar.format.chunking import MAX_CHUNK_SIZE

    assert MAX_CHUNK_SIZE == 64 * MIB
    CheckpointConfig(uri="file:///tmp/x", chunk_size=MAX_CHUNK_SIZE)  # the largest allowed
    with pytest.raises(CheckpointError):
        CheckpointConfig(uri="file:///tmp/x", chunk_size=MAX_CHUNK_SIZE + BS)


@pytest.mark.parametrize(
    ("size", "stored", "what"),
    [
        (384 * MIB, 20, "raw bytes"),  # the review's 20-byte chunk claiming 384 MiB
        (64 * MIB + 1, 64 * MIB + 1, "raw bytes"),
        (-1, 0, "raw size"),
        (4096, 10**12, "stored bytes"),
        (4096, -5, "stored size"),
    ],
)
def test_a_chunk_record_claiming_sizes_beyond_the_format_is_refused(
    size: int, stored: int, what: str
) -> None:
    raw = chunk_json(max(size, 0), stored=stored, codec="zstd")
    raw[1] = size
    with pytest.raises(ValueError, match=what):
        ChunkRef.from_json(raw)
    # and a manifest holding it inline is unreadable; load, verify and ls skip it
    body = inline_body(files={"__0_0.distcp": {"size": max(size, 0), "chunks": [raw]}})
    with pytest.raises(ValueError, match=what):
        Manifest.from_bytes(encoded(body))


def test_a_writer_never_cuts_a_chunk_larger_than_its_chunk_size() -> None:
    """Bytes no item covers (all of .metadata) were packed whole: a .metadata over 64 MiB
    became one chunk every reader now refuses."""
    from trainer_sidecar.format.chunking import Span, plan_chunks

    limit = 64 * MIB  # MAX_CHUNK_SIZE (the test above)
    for items, size in (
        ([], 3 * limit + 5),  # .metadata
        ([Span(0, 10), Span(limit + 10, 10)], limit + 20),  # a gap
    ):
        chunks = plan_chunks(items, file_size=size, chunk_size=limit)
        assert max(c.length for c in chunks) <= limit
        assert sum(c.length for c in chunks) == size
        assert all(a.end == b.offset for a, b in zip(chunks, chunks[1:], strict=False))


def test_a_chunk_of_the_maximum_size_is_accepted() -> None:
    ref = ChunkRef.from_json(chunk_json(64 * MIB, stored=64 * MIB + 64 * MIB // 256, codec="zstd"))
    assert ref.size == 64 * MIB
    checks.check_entry("__0_0.distcp", FileEntry(ref.size, (ref,)), step=2, bs=BS)


def test_a_chunk_record_made_in_memory_beyond_the_maximum_fails_its_check() -> None:
    """check_entry refuses what from_json would (a manifest another rank sent, say)."""
    big = ChunkRef(DIGEST, 384 * MIB, 20, "zstd", (DIGEST,) * 384)
    with pytest.raises(UnsafeCheckpointError, match="maximum chunk size"):
        checks.check_entry("__0_0.distcp", FileEntry(big.size, (big,)), step=2, bs=BS)


def test_decoding_a_claim_the_object_does_not_hold_never_allocates_it() -> None:
    """20 bytes of zstd that decode to 20 bytes, in a record claiming 60 MiB (within the
    maximum): refused having allocated about what decodes, never the claim."""
    stored = zstandard.ZstdCompressor().compress(b"x" * 20)
    for codec in ("zstd", "zstd-bp2", "zstd-bp4"):
        with traced_peak() as peak:
            with pytest.raises(CodecError, match="decompresses to 20 bytes, not its"):
                codecs.decode(stored, codec, size=60 * MIB)
        assert peak[0] < 2 * MIB, (codec, peak[0])


def test_decoding_a_claim_beyond_the_maximum_chunk_size_is_refused_at_once() -> None:
    stored = zstandard.ZstdCompressor().compress(b"x" * 20)
    with traced_peak() as peak:
        with pytest.raises(CodecError, match="maximum chunk size"):
            codecs.decode(stored, "zstd", size=384 * MIB)
    assert peak[0] < MIB, peak[0]


def test_a_chunk_read_costs_what_its_object_holds_not_its_claim() -> None:
    """Through the reader, from a store: the lying record is a corrupt chunk, and the read
    allocated about the 20 bytes, not the 60 MiB claimed."""
    store = MemoryStore()
    stored = zstandard.ZstdCompressor().compress(b"x" * 20)
    blocks = tuple([DIGEST] * 60)
    ref = ChunkRef(DIGEST, 60 * MIB, len(stored), "zstd", blocks)
    store.put(ref.key, stored)
    manifest = Manifest.from_bytes(
        encoded(inline_body(files={"__0_0.distcp": FileEntry(ref.size, (ref,)).to_json()}))
    )
    with traced_peak() as peak:
        with pytest.raises(CorruptCheckpointError, match="decompresses to 20 bytes"):
            ChunkReader(store, manifest).fetch_verified(ref, 0, ref.size)
    assert peak[0] < 2 * MIB, peak[0]


class CountingStore(MemoryStore):
    """A memory store counting the bytes its gets return."""

    def __init__(self) -> None:
        super().__init__()
        self.returned = 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        data = super().get(key, byte_range=byte_range)
        self.returned += len(data)
        return data


def test_a_raw_chunk_larger_than_its_record_is_read_no_further_than_one_byte_past_it() -> None:
    store = CountingStore()
    body = b"y" * 4096
    cid, blocks = hash_chunk(body, 4096)
    ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
    store.put(ref.key, body + bytes(8 * MIB))  # the chunk, then 8 MiB more
    manifest = Manifest.from_bytes(
        encoded(inline_body(block_size=4096, files={"x": FileEntry(ref.size, (ref,)).to_json()}))
    )
    with pytest.raises(CorruptCheckpointError) as info:
        ChunkReader(store, manifest).fetch_verified(ref, 0, ref.size)
    assert store.returned <= len(body) + 1
    assert "is larger than its 4096 bytes" in str(info.value)


def test_a_compressed_chunk_object_larger_than_its_stored_form_can_be_is_not_read_whole() -> None:
    store = CountingStore()
    ref = ChunkRef(DIGEST, 4096, 100, "zstd", (DIGEST,))
    store.put(ref.key, bytes(8 * MIB))
    manifest = Manifest.from_bytes(
        encoded(inline_body(block_size=4096, files={"x": FileEntry(4096, (ref,)).to_json()}))
    )
    with pytest.raises(CorruptCheckpointError) as info:
        ChunkReader(store, manifest).fetch_verified(ref, 0, ref.size)
    assert store.returned <= 4096 + 4096 // 256 + 1024 + 1
    assert "the most 4096 raw bytes are stored in" in str(info.value)


# -- block sizes -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [0, -4096, 1024, 4097, 3 * 4096, 128 * MIB, 1 << 40])
def test_a_block_size_outside_the_range_makes_the_manifest_unreadable(block_size: int) -> None:
    for body in (manifest_body(block_size=block_size), inline_body(block_size=block_size)):
        with pytest.raises(ValueError, match="block size"):
            Manifest.from_bytes(encoded(body))
    store = MemoryStore()
    store.put(manifest_key(2), encoded(manifest_body(block_size=block_size)))
    with pytest.raises(UnsafeCheckpointError, match="its manifest is unreadable.*block size"):
        checks.read_manifest(store, 2)


@pytest.mark.parametrize("block_size", [4096, MIB, 64 * MIB])
def test_block_sizes_in_the_range_are_read(block_size: int) -> None:
    body = inline_body(block_size=block_size)
    body["files"]["__0_0.distcp"]["chunks"][0][4] = [DIGEST]
    checks.check_manifest(Manifest.from_bytes(encoded(body)))


def test_a_rank_manifest_with_a_block_size_outside_the_range_is_refused() -> None:
    files = {"__0_0.distcp": FileEntry(4, (ChunkRef(DIGEST, 4, 4, "none", (DIGEST,)),))}
    part = RankManifest(step=2, rank=0, save=SAVE, block_size=1 << 30, files=files)
    with pytest.raises(ValueError, match="block size 1073741824"):
        RankManifest.from_bytes(part.to_bytes())


def test_check_manifest_refuses_a_block_size_outside_the_range() -> None:
    good = Manifest.from_bytes(encoded(inline_body()))
    bad = dataclasses.replace(good, block_size=1 << 30)
    with pytest.raises(UnsafeCheckpointError, match="block size 1073741824"):
        checks.check_manifest(bad)


# -- world sizes and counts --------------------------------------------------------------


def test_a_1kb_manifest_claiming_six_million_ranks_is_refused_before_allocating_them() -> None:
    data = encoded(manifest_body(world_size=6_000_000))
    assert len(data) < 1024
    with traced_peak() as peak:
        with pytest.raises(ValueError) as info:
            Manifest.from_bytes(data)
    assert peak[0] < MIB, peak[0]  # a list of 6,000,000 ints: 230 MiB
    assert "claims 6000000 ranks, more than its" in str(info.value)
    store = MemoryStore()
    store.put(manifest_key(2), data)
    with traced_peak() as peak:
        with pytest.raises(UnsafeCheckpointError, match="6000000 ranks"):
            checks.read_manifest(store, 2)  # load and verify
        with pytest.raises(CheckpointError, match="6000000 ranks"):
            repository.read_manifest(store, 2)  # ls, show, gc, the sidecar's start-up
        assert repository.latest_manifest(store) is None  # skipped, not a crash
    assert peak[0] < MIB, peak[0]


def test_a_manifest_listing_fewer_ranks_than_its_world_size_is_refused() -> None:
    """Within what its bytes can hold, the world size must still be the ranks it lists."""
    with pytest.raises(ValueError, match=r"not exactly 0\.\.2"):
        Manifest.from_bytes(encoded(manifest_body(world_size=3)))


def test_an_inline_manifest_claiming_more_ranks_than_its_files_can_list_is_refused() -> None:
    data = encoded(inline_body(world_size=1_000_000))
    with pytest.raises(ValueError, match="claims 1000000 ranks"):
        Manifest.from_bytes(data)
    most = len(data) // fmt.MIN_FILE_ENTRY_BYTES
    assert Manifest.from_bytes(encoded(inline_body(world_size=most))).world_size == most


def test_the_fewest_bytes_an_entry_takes_is_what_the_parser_needs() -> None:
    """A rank entry of MIN_RANK_REF_BYTES, and a file entry of MIN_FILE_ENTRY_BYTES, parse;
    so a world size bounded by them never refuses a manifest that lists its ranks."""
    ranks = [{"rank": r, "manifest": "0" * 64, "files": {}} for r in range(50)]
    assert all(len(encoded(r)) >= fmt.MIN_RANK_REF_BYTES for r in ranks)
    data = encoded(manifest_body(world_size=50, ranks=ranks))
    assert Manifest.from_bytes(data).world_size == 50
    assert len(data) // fmt.MIN_RANK_REF_BYTES >= 50
    assert len(b'"":{"size":0,"chunks":[]}') == fmt.MIN_FILE_ENTRY_BYTES


@pytest.mark.parametrize(
    ("where", "value"), [("world_size", -1), ("world_size", True), ("world_size", 2.5)]
)
def test_a_count_that_is_no_non_negative_integer_is_refused(where: str, value: object) -> None:
    with pytest.raises(ValueError, match="world size"):
        Manifest.from_bytes(encoded(manifest_body(**{where: value})))


def test_file_sizes_must_be_non_negative_integers() -> None:
    ranks = [{"rank": 0, "manifest": "0" * 64, "files": {"__0_0.distcp": -4}}]
    with pytest.raises(ValueError, match="file size -4"):
        Manifest.from_bytes(encoded(manifest_body(ranks=ranks)))


# -- object sizes ------------------------------------------------------------------------


@pytest.mark.parametrize("store_kind", ["memory", "local"])
@pytest.mark.parametrize("size", [0, 1, 99, 100, 101, 5000])
def test_read_bounded_reads_at_most_one_byte_past_the_bound(
    store_kind: str, size: int, tmp_path: Path
) -> None:
    from trainer_sidecar.store.base import read_bounded

    store = MemoryStore() if store_kind == "memory" else LocalStore(tmp_path)
    body = bytes(range(256)) * 20
    store.put("k", body[:size])
    got = read_bounded(store, "k", 100)
    assert got == body[: min(size, 101)]


@pytest.mark.parametrize(
    ("kind", "limit", "parse"),
    [
        ("manifest", "MAX_MANIFEST_BYTES", Manifest.from_bytes),
        ("rank manifest", "MAX_RANK_MANIFEST_BYTES", RankManifest.from_bytes),
        ("part", "MAX_PART_BYTES", RankPart.from_bytes),
    ],
)
def test_an_object_larger_than_its_kind_may_be_is_refused_before_it_is_parsed(
    kind: str, limit: str, parse: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """(With the limit made small: the real ones are hundreds of MiB.)"""
    monkeypatch.setattr(fmt, limit, 1000, raising=False)
    data = b"[" + b"{}," * 20000 + b"{}]"  # would parse to 20001 dicts
    with traced_peak() as peak:
        with pytest.raises(Exception) as info:  # noqa: PT011 - the message is checked below
            parse(data)
    assert peak[0] < 64 << 10, peak[0]  # parsed: over 1 MiB
    assert f"larger than the 1000 bytes a {kind} may be" in str(info.value)


def test_the_object_limits_are_documented_values() -> None:
    assert fmt.MAX_MANIFEST_BYTES == 256 * MIB
    assert fmt.MAX_RANK_MANIFEST_BYTES == 256 * MIB
    assert fmt.MAX_PART_BYTES == 256 * MIB
    assert fmt.MAX_METADATA_BYTES == 1024 * MIB


class LargeObjects(MemoryStore):
    """A memory store where every object is ``size`` bytes: what a get returns shows how
    much of it a reader took."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.size = size
        self.returned = 0

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        start, end = byte_range or (0, self.size)
        data = b" " * (min(end, self.size) - start)
        self.returned += len(data)
        return data


def test_load_reads_a_manifest_no_further_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fmt, "MAX_MANIFEST_BYTES", 1000, raising=False)
    monkeypatch.setattr(checks, "MAX_MANIFEST_BYTES", 1000, raising=False)
    store = LargeObjects(50 * MIB)
    with pytest.raises(UnsafeCheckpointError) as info:
        checks.read_manifest(store, 2)
    assert store.returned == 1001
    assert "larger than the 1000 bytes a manifest may be" in str(info.value)


def test_a_rank_manifest_is_read_no_further_than_its_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A version 3 manifest bound for a load (checks.bind) fetches its rank manifests with
    the bound; one larger is a corrupt checkpoint."""
    monkeypatch.setattr(fmt, "MAX_RANK_MANIFEST_BYTES", 1000, raising=False)
    monkeypatch.setattr(checks, "MAX_RANK_MANIFEST_BYTES", 1000, raising=False)
    store = LargeObjects(50 * MIB)
    manifest = checks.bind(store, Manifest.from_bytes(encoded(manifest_body())))
    with pytest.raises(CorruptCheckpointError) as info:
        manifest.files["__0_0.distcp"]  # noqa: B018
    assert store.returned == 1001
    assert "larger than the 1000 bytes a rank manifest may be" in str(info.value)


# -- .metadata ---------------------------------------------------------------------------


def metadata_checkpoint(body: bytes, *, size: int | None = None) -> ChunkReader:
    """A reader over a checkpoint whose .metadata is ``body`` (one chunk, stored raw)."""
    store = MemoryStore()
    cid, blocks = hash_chunk(body, BS)
    ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
    store.put(ref.key, body)
    files = {METADATA_FILE: FileEntry(len(body), (ref,)).to_json()}
    if size is not None:  # what the manifest claims instead
        files[METADATA_FILE]["size"] = size
    manifest = Manifest.from_bytes(encoded(inline_body(files=files)))
    return ChunkReader(store, manifest)


def long_binput(index: int) -> bytes:
    """A 12-byte pickle: None, stored in the memo at ``index`` (LONG_BINPUT)."""
    return b"\x80\x04N" + b"r" + struct.pack("<I", index) + b"."


def test_a_metadata_pickle_naming_a_huge_memo_index_is_refused_before_unpickling() -> None:
    """The C unpickler sizes its memo to twice the largest index it is given and clears it:
    a 12-byte .metadata naming index 2**24 cost 256 MiB (2**31: 32 GiB, the OOM killer)."""
    reader = metadata_checkpoint(long_binput(1 << 24))
    with traced_peak() as peak:
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
            read_checked_metadata(reader)
    assert peak[0] < 8 * MIB, peak[0]
    from trainer_sidecar.load.checks import check_pickle

    with pytest.raises(
        UnsafeCheckpointError, match="memo entry 16777216 at byte 3, after 0 entries"
    ):
        check_pickle(long_binput(1 << 24), step=2)
    check_pickle(long_binput(0), step=2)  # the first entry: fine


def test_a_metadata_pickle_claiming_more_bytes_than_it_holds_is_refused_unallocated() -> None:
    """BINBYTES8 of 1 GiB in a 20-byte pickle: the C unpickler allocates the claim first."""
    data = b"\x80\x04\x8e" + struct.pack("<Q", 1 << 30) + b"abc."
    reader = metadata_checkpoint(data)
    with traced_peak() as peak:
        with pytest.raises(UnsafeCheckpointError, match=r"\.metadata"):
            read_checked_metadata(reader)
    assert peak[0] < 8 * MIB, peak[0]


def test_real_metadata_passes_the_pickle_check() -> None:
    from trainer_sidecar.load.checks import check_pickle

    md = Metadata(
        {"extra.step": BytesStorageMetadata()},
        storage_data={MetadataIndex("extra.step"): ("__0_1.distcp", 0, 10)},
    )
    check_pickle(pickle.dumps(md), step=2)
    sd = torch.nn.Linear(4, 4).state_dict()
    check_pickle(pickle.dumps(sd), step=2)  # memoizes many objects, all in order


def test_a_metadata_larger_than_its_limit_is_refused_before_it_is_read() -> None:
    reader = metadata_checkpoint(b"x" * 10, size=fmt.MAX_METADATA_BYTES + 1)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata is 1073741825 bytes"):
        read_checked_metadata(reader)
    assert reader.stats.bytes_fetched == 0


def test_metadata_items_sharing_bytes_are_refused() -> None:
    """Items lie end to end: overlapping ones would let a small .metadata have one file's
    bytes fetched and decoded once per item."""
    storage = {MetadataIndex(f"extra.v{i}"): ("__0_1.distcp", 0, 1000) for i in range(3)}
    md = Metadata({f"extra.v{i}": BytesStorageMetadata() for i in range(3)}, storage_data=storage)
    with pytest.raises(UnsafeCheckpointError, match="on the same bytes of __0_1.distcp"):
        checks.check_metadata(md, step=2, file_sizes={"__0_1.distcp": 1000})
    storage = {MetadataIndex(f"extra.v{i}"): ("__0_1.distcp", i * 10, 10) for i in range(3)}
    storage[MetadataIndex("extra.empty")] = ("__0_1.distcp", 10, 0)
    entries = {f"extra.v{i}": BytesStorageMetadata() for i in range(3)}
    entries["extra.empty"] = BytesStorageMetadata()
    checks.check_metadata(
        Metadata(entries, storage_data=storage), step=2, file_sizes={"__0_1.distcp": 30}
    )


# -- the sidecar's start-up --------------------------------------------------------------


def test_a_sidecar_whose_start_up_read_fails_otherwise_than_the_store_persists_anyway(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A MemoryError (or a bug) reading the latest commit is not a store not there yet:
    the sidecar says so and persists, instead of exiting into a crash loop."""
    from trainer_sidecar import sidecar
    from trainer_sidecar.save.persist import Persister

    def publish_latest(self: Persister) -> None:
        raise MemoryError

    ran: list[bool] = []
    monkeypatch.setattr(Persister, "publish_latest", publish_latest)
    monkeypatch.setattr(Persister, "run", lambda self, stop, *, grace_s: ran.append(True))
    config = CheckpointConfig(
        uri=f"file://{tmp_path / 'ckpt'}", sidecar=True, staging_dir=str(tmp_path / "staging")
    )
    with caplog.at_level("ERROR", logger="ctj.sidecar"):
        assert sidecar.run(config, metrics_port=None, grace_s=0.1) == 0
    assert ran == [True]
    assert "cannot read the latest committed checkpoint at start-up" in caplog.text
    assert "MemoryError" in caplog.text
