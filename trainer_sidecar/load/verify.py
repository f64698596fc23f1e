"""Verify a committed checkpoint: read every chunk it names and check every block, then
check that it would load safely (its manifest well-formed, its ``.metadata`` accepted by
the allow-list, its non-tensor values by weights_only rules)."""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable

from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from ..errors import CorruptCheckpointError
from ..format.manifest import Manifest
from ..store.base import ObjectStore
from .checks import check_manifest, storage_location
from .chunk_reader import ChunkReader
from .dcp_reader import read_checked_metadata
from .planner import decode_value


def verify(
    store: ObjectStore,
    manifest: Manifest,
    *,
    progress: Callable[[int], None] | None = None,
    parallelism: int = 8,
    trust_pickled_values: bool = False,
) -> list[CorruptCheckpointError]:
    """Check a checkpoint; returns the problems found (UnsafeCheckpointError among them).

    Nothing in it is ever run: ``.metadata`` goes through the allow-list and values
    through weights_only (or, with ``trust_pickled_values``, are not decoded at all).
    """
    try:
        check_manifest(manifest)
    except CorruptCheckpointError as exc:  # its chunk keys can't be trusted: read nothing
        return [exc]
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
    problems.sort(key=lambda p: p.chunk_id)
    if problems:
        return problems
    return _check_contents(reader, trust_pickled_values=trust_pickled_values)


def _check_contents(
    reader: ChunkReader, *, trust_pickled_values: bool
) -> list[CorruptCheckpointError]:
    """Every chunk is sound: would the checkpoint load safely?"""
    step = reader.manifest.step
    try:
        metadata = read_checked_metadata(reader)
    except CorruptCheckpointError as exc:
        return [exc]
    if trust_pickled_values:
        return []
    values = []
    for index, value in metadata.storage_data.items():
        where = storage_location(value)
        md = metadata.state_dict_metadata[index.fqn]
        if where is not None and isinstance(md, BytesStorageMetadata):
            values.append((index.fqn, where))
    datas = reader.read_ranges([(name, off, off + n) for _, (name, off, n) in values])
    problems: list[CorruptCheckpointError] = []
    for (fqn, _), data in zip(values, datas, strict=True):
        try:
            decode_value(data, step=step, fqn=fqn, trusted=False)
        except CorruptCheckpointError as exc:
            problems.append(exc)
    return problems
