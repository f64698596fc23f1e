"""Verify a committed checkpoint: read every chunk it names and check every block."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest
from ..store.base import ObjectStore
from .chunk_reader import ChunkReader


def verify(
    store: ObjectStore,
    manifest: Manifest,
    *,
    progress: Callable[[int], None] | None = None,
    parallelism: int = 8,
) -> list[CorruptCheckpointError]:
    """Read every chunk of a checkpoint and check it; returns the problems found."""
    reader = ChunkReader(store, manifest, parallelism=parallelism)
    chunks = {c.id: c for f in manifest.files.values() for c in f.chunks}
    problems: list[CorruptCheckpointError] = []

    def check(chunk_id: str) -> None:
        chunk = chunks[chunk_id]
        try:
            reader.fetch_verified(chunk, 0, chunk.size)
        except CorruptCheckpointError as exc:
            problems.append(exc)
        if progress:
            progress(chunk.size)

    with cf.ThreadPoolExecutor(parallelism) as pool:
        list(pool.map(check, sorted(chunks)))
    return sorted(problems, key=lambda p: p.chunk_id)
