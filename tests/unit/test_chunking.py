from __future__ import annotations

import pytest

from trainer_sidecar.format.chunking import Span, blocks_for_range, hash_chunk, plan_chunks

KB = 1024


@pytest.mark.parametrize(
    ("items", "file_size", "want"),
    [
        # a large item is cut from its own start into chunk_size pieces
        ([Span(0, 10 * KB)], 10 * KB, [(0, 4 * KB), (4 * KB, 4 * KB), (8 * KB, 2 * KB)]),
        # small items are packed up to pack_size, then a new pack starts
        ([Span(0, KB), Span(KB, KB), Span(2 * KB, KB)], 3 * KB, [(0, 2 * KB), (2 * KB, KB)]),
        # a large item closes the pack before it and starts at its own offset
        (
            [Span(0, KB), Span(KB, 5 * KB), Span(6 * KB, KB)],
            7 * KB,
            [(0, KB), (KB, 4 * KB), (5 * KB, KB), (6 * KB, KB)],
        ),
        # bytes after the last item are still covered
        ([Span(0, KB)], 3 * KB, [(0, KB), (KB, 2 * KB)]),
        ([], 0, []),
    ],
)
def test_plan_chunks(items: list[Span], file_size: int, want: list[tuple[int, int]]) -> None:
    got = plan_chunks(items, file_size=file_size, chunk_size=4 * KB, pack_size=2 * KB)
    assert [(c.offset, c.length) for c in got] == want
    assert sum(c.length for c in got) == file_size


def test_unchanged_item_keeps_its_chunks_when_a_neighbour_changes() -> None:
    items = [Span(0, 3 * KB), Span(3 * KB, 9 * KB)]
    before = plan_chunks(items, file_size=12 * KB, chunk_size=4 * KB, pack_size=2 * KB)
    data = bytearray(b"a" * 3 * KB + bytes(range(256)) * 36)
    ids_before = [hash_chunk(data[c.offset : c.end], KB)[0] for c in before]
    data[0:10] = b"b" * 10  # change the first item only
    ids_after = [hash_chunk(data[c.offset : c.end], KB)[0] for c in before]
    changed = [i for i, (x, y) in enumerate(zip(ids_before, ids_after, strict=True)) if x != y]
    assert changed == [0]


def test_overlapping_items_are_rejected() -> None:
    with pytest.raises(ValueError, match="overlapping"):
        plan_chunks([Span(0, 10), Span(5, 10)], file_size=15, chunk_size=4096, pack_size=1024)


def test_chunk_id_depends_on_every_block() -> None:
    a = bytes(3 * KB)
    b = bytes(2 * KB) + b"\x01" + bytes(KB - 1)
    id_a, blocks_a = hash_chunk(a, KB)
    id_b, blocks_b = hash_chunk(b, KB)
    assert id_a != id_b
    assert blocks_a[:2] == blocks_b[:2] and blocks_a[2] != blocks_b[2]
    assert len(blocks_a) == 3


@pytest.mark.parametrize(
    ("start", "end", "want"),
    [
        (0, 1, (0, KB)),
        (KB + 5, KB + 6, (KB, 2 * KB)),
        (10, 2500, (0, 2500)),
        (2048, 2500, (2048, 2500)),
    ],
)
def test_blocks_for_range(start: int, end: int, want: tuple[int, int]) -> None:
    assert blocks_for_range(start, end, 2500, KB) == want
