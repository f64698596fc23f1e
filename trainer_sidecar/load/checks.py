"""Checks on what a bucket writer wrote, before any of it is used.

A manifest and a ``.metadata`` are both untrusted input: anyone who can write
the bucket can write them. Hash checks prove the bytes are the ones the
manifest names, not that the manifest is honest. These checks make a
malformed or hostile checkpoint an ``UnsafeCheckpointError`` (skipped like a
corrupt one) instead of a crash, a hang, a read outside the checkpoint, or a
file written outside an export directory.
"""

from __future__ import annotations

import functools
import itertools
import math
import pickletools
import re
from collections.abc import Mapping

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ..errors import NoCheckpointError, ObjectNotFound, UnsafeCheckpointError
from ..format.chunking import block_size_problem, chunk_size_problem
from ..format.manifest import (
    MAX_MANIFEST_BYTES,
    MAX_RANK_MANIFEST_BYTES,
    METADATA_FILE,
    Codec,
    FileEntry,
    Manifest,
    RankFiles,
    manifest_key,
)
from ..store.base import ObjectStore, bounded_reader, read_bounded

_CHUNK_ID = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"[0-9a-f]{64}")


def check_file_name(name: object, *, step: int) -> str:
    """``name`` if it is a plain file name (one path component: no separator, no ``..``,
    not absolute, no NUL); else UnsafeCheckpointError. Export writes only such names."""
    if (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and not any(c in name for c in ("/", "\\", "\0"))
        and name.isprintable()
    ):
        return name
    raise UnsafeCheckpointError(
        step, f"file name {name!r}", "is not a plain name inside the checkpoint directory"
    )


def read_manifest(store: ObjectStore, step: int) -> Manifest:
    """A committed manifest, parsed and checked (check_manifest). Raises NoCheckpointError
    when it is gone, UnsafeCheckpointError when it is unreadable or malformed, and the
    store's own errors (unreachable, credentials) as they are.

    A version 3 manifest's rank manifests are read later, each only when a file of its
    rank is first needed, and checked then (hash, parse, then as here): a bad one makes
    that read raise a CorruptCheckpointError, which restore skips like a corrupt chunk."""
    try:  # at most MAX_MANIFEST_BYTES (+1: Manifest.from_bytes refuses a larger one)
        data = read_bounded(store, manifest_key(step), MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        raise NoCheckpointError(f"no committed checkpoint at step {step}") from None
    try:
        manifest = Manifest.from_bytes(data)
    except Exception as exc:  # noqa: BLE001 - whatever the bytes hold, it is no manifest
        raise UnsafeCheckpointError(step, "its manifest", f"is unreadable ({exc})") from None
    if manifest.step != step:
        raise UnsafeCheckpointError(step, "its manifest", f"says step {manifest.step}")
    check_manifest(manifest, entries=not manifest.ranks)
    return bind(store, manifest)


def bind(store: ObjectStore, manifest: Manifest) -> Manifest:
    """``manifest`` reading its rank manifests from ``store``, each checked as it loads
    (for a copy another rank sent: what travels carries no store), each read bounded by
    MAX_RANK_MANIFEST_BYTES. One already reading from a store is returned as it is, with
    what it has loaded."""
    if not isinstance(manifest.files, RankFiles) or manifest.files.has_store:
        return manifest
    return manifest.bound(
        bounded_reader(store, MAX_RANK_MANIFEST_BYTES),
        functools.partial(check_entry, step=manifest.step, bs=manifest.block_size),
    )


def check_manifest(manifest: Manifest, *, entries: bool = True) -> None:
    """Raise UnsafeCheckpointError unless the block size is in the format's range and every
    file is a plain name whose chunks add up to its size, each chunk a BLAKE3 id within
    the format's size limits with one digest per block. ``entries=False`` checks the
    names alone (a version 3 manifest: its chunk lists are checked as they load); with
    entries, a version 3 manifest reads every rank manifest."""
    step, bs = manifest.step, manifest.block_size
    problem = block_size_problem(bs)
    if problem:
        raise UnsafeCheckpointError(step, "the manifest", f"has block size {bs}, which {problem}")
    for name in manifest.files:
        check_file_name(name, step=step)
    if entries:
        for name, entry in manifest.files.items():
            check_entry(name, entry, step=step, bs=bs)


def check_entry(name: str, entry: FileEntry, *, step: int, bs: int) -> None:
    """One file's chunk list: a plain name, chunks within the format's size limits that add
    up, ids and digests well-formed."""
    check_file_name(name, step=step)
    for c in entry.chunks:
        problem = chunk_size_problem(c.size, c.stored_size)
        if problem:
            raise UnsafeCheckpointError(
                step, f"file {name}", f"has a chunk {c.id!r} that {problem}"
            )
    if sum(c.size for c in entry.chunks) != entry.size:
        raise UnsafeCheckpointError(step, f"file {name}", "has chunks that do not add up")
    for c in entry.chunks:
        if (
            not _CHUNK_ID.fullmatch(c.id)
            or c.codec not in tuple(Codec)
            or c.size < 0
            or len(c.blocks) != max(1, -(-c.size // bs))
            or not all(isinstance(d, str) and _DIGEST.fullmatch(d) for d in c.blocks)
        ):
            raise UnsafeCheckpointError(step, f"file {name}", f"has a malformed chunk {c.id!r}")


def _ints(value: object, n: int | None = None) -> bool:
    return (
        isinstance(value, tuple | list)
        and (n is None or len(value) == n)
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    )


def storage_location(value: object) -> tuple[str, int, int] | None:
    """``(file name, offset, length)`` of a ``storage_data`` value (ctj's plain tuple, or a
    file-system ``_StorageInfo``); None when it is neither."""
    if isinstance(value, _StorageInfo):
        value = (value.relative_path, value.offset, value.length)
    if (
        isinstance(value, tuple)
        and len(value) == 3
        and isinstance(value[0], str)
        and _ints(value[1:])
    ):
        return value[0], int(value[1]), int(value[2])
    return None


def check_metadata(metadata: Metadata, *, step: int, file_sizes: Mapping[str, int]) -> None:
    """Raise UnsafeCheckpointError unless ``metadata`` is well-formed and every item lies
    inside a file of the checkpoint (``file_sizes``: the manifest's files and sizes).

    After this, reading the checkpoint can only fail for the store, for a chunk that
    fails its hash, or for a state that does not match: never for a malformed record.
    """

    def bad(reason: str) -> UnsafeCheckpointError:
        return UnsafeCheckpointError(step, ".metadata", reason)

    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict) or not all(isinstance(k, str) for k in entries):
        raise bad("has no state_dict_metadata mapping names to items")
    itemsize: dict[str, int] = {}
    for fqn, md in entries.items():
        if isinstance(md, BytesStorageMetadata):
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise bad(f"describes {fqn!r} as a {type(md).__name__}")
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not _ints(md.size):
            raise bad(f"gives {fqn!r} no dtype or a malformed size")
        if not isinstance(md.chunks, list) or not all(
            isinstance(c, ChunkStorageMetadata)
            and _ints(c.offsets, len(md.size))
            and _ints(c.sizes, len(md.size))
            and all(o + n <= d for o, n, d in zip(c.offsets, c.sizes, md.size, strict=True))
            for c in md.chunks
        ):
            raise bad(f"gives {fqn!r} malformed chunks")
        itemsize[fqn] = torch.empty((), dtype=dtype).element_size()
    planner_data = metadata.planner_data
    if planner_data is not None and not (
        isinstance(planner_data, dict)
        and all(
            isinstance(k, str)
            and isinstance(v, tuple | list)
            and all(isinstance(p, str | int) for p in v)
            for k, v in planner_data.items()
        )
    ):
        raise bad("has malformed planner_data")
    storage = metadata.storage_data
    if not isinstance(storage, dict):
        raise bad("has no storage_data")
    placed: dict[str, list[tuple[int, int, str]]] = {}
    for index, value in storage.items():
        if not (
            isinstance(index, MetadataIndex)
            and isinstance(index.fqn, str)
            and (index.offset is None or _ints(index.offset))
            and (index.index is None or isinstance(index.index, int))
        ):
            raise bad(f"has a storage_data key {index!r} that is not a MetadataIndex")
        described = entries.get(index.fqn)
        if described is None:
            raise bad(f"stores {index.fqn!r}, which it does not describe")
        where = storage_location(value)
        if where is None:
            raise bad(f"places {index.fqn!r} at {value!r}, not (file, offset, length)")
        name, offset, length = where
        if name not in file_sizes:
            raise bad(f"places {index.fqn!r} in {name!r}, a file the checkpoint does not have")
        if offset + length > file_sizes[name]:
            raise bad(f"places {index.fqn!r} past the end of {name}")
        if length:
            placed.setdefault(name, []).append((offset, offset + length, index.fqn))
        if isinstance(described, TensorStorageMetadata):
            chunk = _chunk_of(described, index)
            if chunk is None:
                raise bad(f"stores a chunk of {index.fqn!r} it does not describe")
            if length != math.prod(chunk.sizes) * itemsize[index.fqn]:
                raise bad(f"gives a chunk of {index.fqn!r} a length its shape does not have")
    overlap = _overlap(placed)
    if overlap:
        raise bad(overlap)


def _overlap(placed: Mapping[str, list[tuple[int, int, str]]]) -> str | None:
    """What overlaps, when two items share bytes of a file (``placed``: each file's items as
    ``(start, end, fqn)``). A writer lays items end to end, so the items of a checkpoint
    add up to at most its files' sizes; overlapping ones would let a small ``.metadata``
    make a reader fetch and decode one file's bytes once per item."""
    for name, spans in placed.items():
        spans.sort()
        for (_, end, first), (start, _, second) in itertools.pairwise(spans):
            if start < end:
                return f"places {first!r} and {second!r} on the same bytes of {name}"
    return None


# pickle opcodes that store into the memo at an index the pickle gives
_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def check_pickle(data: bytes, *, step: int, what: str = METADATA_FILE) -> None:
    """Raise UnsafeCheckpointError unless every count in the pickle ``data`` is bounded by
    its own bytes, before the C unpickler trusts them (``pickle_problem``)."""
    problem = pickle_problem(data)
    if problem:
        raise UnsafeCheckpointError(step, what, f"does not unpickle as DCP metadata ({problem})")


def pickle_problem(data: bytes) -> str | None:
    """What in the pickle ``data`` claims more than its bytes hold, or makes it no pickle;
    None when nothing does. Each memo index must be at most the number of objects
    memoized before it (the C unpickler sizes its memo to twice the largest index and
    clears it: a 12-byte pickle naming index 2**31 costs 32 GiB), and each counted
    argument (bytes, strings, frames, longs) must lie inside the data (the C unpickler
    allocates what the count says first). One pass over the opcodes (pickletools.genops,
    which reads nothing the data does not hold)."""
    stored = 0
    try:
        for op, arg, pos in pickletools.genops(data):
            if op.name in _MEMO_PUTS:
                if not isinstance(arg, int) or not 0 <= arg <= stored:
                    return f"memo entry {arg!r} at byte {pos}, after {stored} entries"
                stored += 1
            elif op.name == "MEMOIZE":
                stored += 1
    except Exception as exc:  # noqa: BLE001 - genops: an unknown opcode, a count past the end
        return f"not a well-formed pickle: {exc}"
    return None


def _chunk_of(md: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    """The chunk a storage_data key names: by its index hint, else by its offsets."""
    offset = None if index.offset is None else tuple(index.offset)
    i = index.index
    if i is not None and 0 <= i < len(md.chunks):
        if offset is None or tuple(md.chunks[i].offsets) == offset:
            return md.chunks[i]
    return next((c for c in md.chunks if tuple(c.offsets) == offset), None)
