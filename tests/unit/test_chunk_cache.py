"""The node-local chunk cache: whole entries only, bounded, least recently used first out."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainer_sidecar.store.chunk_cache import ChunkCache


def cid(n: int) -> str:
    return f"{n:064x}"


def test_an_entry_reads_back_by_range_and_a_missing_one_is_none(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    cache.keep(cid(1), b"hello world")
    assert cache.read(cid(1), 0, 5) == b"hello"
    assert cache.read(cid(1), 6, 11) == b"world"
    assert cache.read(cid(1), 6, 12) is None  # past its end: as good as missing
    assert cache.read(cid(2), 0, 1) is None
    assert cache.size_of(cid(1)) == 11 and cache.bytes_held == 11


def test_ids_that_are_not_chunk_ids_never_become_paths(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", 1 << 20)
    for bad in ("../../etc/passwd", "ab", cid(0xABC).upper(), cid(1) + "/x"):
        assert cache.read(bad, 0, 1) is None and cache.size_of(bad) is None
        with pytest.raises(ValueError):
            cache.keep(bad, b"x")


def test_beyond_its_bound_the_least_recently_used_entries_go(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1000)
    for n in range(4):
        cache.keep(cid(n), bytes(200))
        os.utime(cache.path(cid(n)), (n, n))  # entry n last used at time n
    cache.read(cid(0), 0, 1)  # 0 is used again: now the most recent
    cache.keep(cid(4), bytes(200))
    cache.keep(cid(5), bytes(200))  # 1200 > 1000: evict down to 900
    held = {e.chunk_id for e in cache.entries()}
    assert held == {cid(0), cid(3), cid(4), cid(5)}
    assert cache.bytes_held == 800 <= 1000


def test_a_second_process_sees_entries_and_in_flight_writes_are_not_entries(
    tmp_path: Path,
) -> None:
    ChunkCache(tmp_path, 1 << 20).keep(cid(7), b"x" * 10)
    (tmp_path / "00").mkdir(exist_ok=True)
    (tmp_path / "00" / f".{cid(8)}.123.456.tmp").write_bytes(b"partial")
    crashed = tmp_path / "00" / f".{cid(9)}.1.2.tmp"
    crashed.write_bytes(b"cut short")
    os.utime(crashed, (0, 0))  # written long ago: a write a crash cut short
    other = ChunkCache(tmp_path, 1 << 20)
    assert [e.chunk_id for e in other.entries()] == [cid(7)]
    assert other.bytes_held == 10
    assert not crashed.exists() and (tmp_path / "00" / f".{cid(8)}.123.456.tmp").exists()


def test_a_discarded_entry_is_gone_and_kept_again_on_the_next_save(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    cache.keep(cid(1), b"abc")
    cache.discard(cid(1))
    assert cache.read(cid(1), 0, 3) is None and cache.bytes_held == 0
    cache.keep(cid(1), b"abc")
    assert cache.read(cid(1), 0, 3) == b"abc"


def test_a_cache_that_cannot_be_written_switches_itself_off(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path, 1 << 20)
    (tmp_path / cid(1)[:2]).write_text("a file where a directory must be")
    cache.keep(cid(1), b"abc")  # no exception: the save goes on without the cache
    cache.keep(cid(2 << 248), b"abc")
    assert cache.entries() == []


def test_a_cache_directory_that_cannot_be_made_is_no_cache_not_an_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a directory")
    cache = ChunkCache(tmp_path / "file" / "cache", 1 << 20)
    cache.keep(cid(1), b"abc")
    assert cache.read(cid(1), 0, 3) is None and cache.entries() == []
