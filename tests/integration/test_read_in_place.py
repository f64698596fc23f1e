"""A load's chunk GETs go from the socket into the tensors' memory (S3Store.get_into) and
are verified there: on a real S3 server, the bytes are right, each whole-chunk read asks
one byte more than the chunk, and a chunk object that is larger, shorter or altered is
refused as from any other store."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import pytest

from tests.conftest import traced_peak
from tests.unit.test_bounds import encoded, inline_body
from trainer_sidecar.errors import CorruptCheckpointError
from trainer_sidecar.format.chunking import hash_chunk
from trainer_sidecar.format.manifest import ChunkRef, FileEntry, Manifest
from trainer_sidecar.load.chunk_reader import MAX_SCRATCH, ChunkReader
from trainer_sidecar.store.base import Location
from trainer_sidecar.store.s3 import S3Settings, S3Store

pytestmark = pytest.mark.integration

MIB = 1 << 20


class CountingS3(S3Store):
    """The real store, counting the byte ranges its in-place GETs ask for."""

    def __init__(self, uri: str) -> None:
        super().__init__(Location.parse(uri), S3Settings.from_env())
        self.ranges: list[tuple[int, int]] = []

    def get_into(self, key: str, into: Sequence[memoryview], *, byte_range: tuple[int, int]) -> int:
        self.ranges.append(byte_range)
        return super().get_into(key, into, byte_range=byte_range)


def planted(uri: str, body: bytes, stored: bytes) -> tuple[CountingS3, ChunkReader, ChunkRef]:
    """A one-chunk file of ``body`` (1 MiB blocks) whose object holds ``stored``."""
    store = CountingS3(uri)
    cid, blocks = hash_chunk(body, MIB)
    ref = ChunkRef(cid, len(body), len(body), "none", tuple(blocks))
    store.put(ref.key, stored)
    files = {"w": FileEntry(ref.size, (ref,)).to_json()}
    manifest = Manifest.from_bytes(encoded(inline_body(block_size=MIB, files=files)))
    return store, ChunkReader(store, manifest), ref


def test_a_whole_chunk_lands_in_place_and_a_block_range_too(s3_uri: str) -> None:
    body = os.urandom(3 * MIB + 5)
    store, reader, ref = planted(s3_uri, body, body)
    out = np.zeros(len(body), np.uint8)
    part = np.zeros(MIB, np.uint8)
    views = reader.read_ranges([("w", 0, len(body))], into=[out.data])
    assert bytes(views[0]) == body and out.tobytes() == body
    reader.read_ranges([("w", MIB, 2 * MIB)], into=[part.data])
    assert part.tobytes() == body[MIB : 2 * MIB]
    assert store.ranges == [(0, len(body) + 1), (MIB, 2 * MIB)]
    assert reader.stats.bytes_fetched == len(body) + MIB
    # ranges that are not block-aligned: their blocks' GET, the bytes wanted going into
    # place and the others into scratch, every block hashed across the buffers it fell in
    odd, other = np.zeros(10, np.uint8), np.zeros(MIB + 9, np.uint8)
    reader.read_ranges(
        [("w", MIB + 3, MIB + 13), ("w", MIB + 20, 2 * MIB + 29)], into=[odd.data, other.data]
    )
    assert odd.tobytes() == body[MIB + 3 : MIB + 13]
    assert other.tobytes() == body[MIB + 20 : 2 * MIB + 29]
    assert store.ranges[2:] == [(MIB, 3 * MIB)]  # one GET of the two blocks both touch


HOSTILE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "larger": (lambda b: b + bytes(8 * MIB), "is larger than its"),
    "shorter": (lambda b: b[:-MIB], "is truncated"),
    "altered": (lambda b: b[:MIB] + bytes([b[MIB] ^ 1]) + b[MIB + 1 :], "fails its hash check"),
    "missing": (lambda b: b"", "is missing"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_chunk_object_is_refused_in_place(kind: str, s3_uri: str) -> None:
    body = os.urandom(3 * MIB)
    change, says = HOSTILE[kind]
    store, reader, ref = planted(s3_uri, body, change(body))
    if kind == "missing":
        store.delete([ref.key])
    out = np.zeros(len(body), np.uint8)
    with pytest.raises(CorruptCheckpointError, match=says):
        reader.read_ranges([("w", 0, len(body))], into=[out.data])
    assert store.ranges == [(0, len(body) + 1)]
    assert reader.stats.bytes_fetched <= len(body)  # the larger object: not read at all


def test_a_block_altered_where_no_range_reads_is_still_refused(s3_uri: str) -> None:
    """The bytes between two ranges go to scratch, and are hashed like the rest."""
    body = os.urandom(2 * MIB)
    altered = bytearray(body)
    altered[MIB + 100] ^= 1  # between the two ranges below
    store, reader, ref = planted(s3_uri, body, bytes(altered))
    a, b = np.zeros(50, np.uint8), np.zeros(50, np.uint8)
    with pytest.raises(CorruptCheckpointError, match="fails its hash check"):
        reader.read_ranges(
            [("w", MIB, MIB + 50), ("w", MIB + 200, MIB + 250)], into=[a.data, b.data]
        )
    assert store.ranges == [(MIB, 2 * MIB)]


def test_a_record_claiming_more_than_its_object_holds_costs_about_the_object(
    s3_uri: str,
) -> None:
    """Scratch for the bytes around a range is set aside before the GET: at most
    MAX_SCRATCH of it, so a record's claim (60 MiB, 20 bytes stored) cannot make a read
    allocate what the object does not hold. With 4 MiB blocks a 10-byte range would need
    more: it is read the plain way, into a buffer the size of what arrives."""
    store = CountingS3(s3_uri)
    out = np.zeros(10, np.uint8)
    for block_size in (MIB, 4 * MIB):
        blocks = ("ab" * 32,) * (60 * MIB // block_size)
        ref = ChunkRef("ab" * 32, 60 * MIB, 60 * MIB, "none", blocks)
        store.put(ref.key, b"x" * 20)
        files = {"w": FileEntry(ref.size, (ref,)).to_json()}
        body = inline_body(block_size=block_size, files=files)
        reader = ChunkReader(store, Manifest.from_bytes(encoded(body)))
        with traced_peak() as peak:
            with pytest.raises(CorruptCheckpointError, match="is truncated"):
                reader.read_ranges([("w", 5, 15)], into=[out.data])
        assert peak[0] < MAX_SCRATCH + MIB, (block_size, peak[0])
    assert store.ranges == [(0, MIB)]  # 1 MiB blocks: in place; 4 MiB: the plain GET
