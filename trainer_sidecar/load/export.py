"""Export a committed checkpoint as a plain DCP directory (and optionally one file).

The result is what ``torch.distributed.checkpoint.FileSystemWriter`` would have
written: each tensor serialized with ``torch.save`` at the offsets recorded in
``.metadata``, so stock ``torch.distributed.checkpoint.load`` (FileSystemReader)
reads it with no ctj installed. Every byte is hash-verified on the way.

Stock DCP trusts what it reads (``torch.load(weights_only=False)`` for values,
``pickle`` for ``.metadata``), so nothing untrusted is passed on: ``.metadata``
is unpickled by the allow-list and pickled afresh, every non-tensor value must
load by weights_only rules before anything is written (unless
``trust_pickled_values``), and every file name must be a plain name inside the
output directory. ``.metadata`` is written last: a failed export leaves no
directory DCP would load.

An export never overwrites: the directory must be new or empty, and every file (the
``torch.save`` one too) is created exclusively, so no file of the user's, however a
checkpoint names its files, is ever truncated or replaced.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex

from ..errors import CheckpointError
from ..format.manifest import METADATA_FILE, Manifest
from ..store.base import ObjectStore
from .checks import check_file_name, check_manifest, storage_location
from .chunk_reader import ChunkReader
from .dcp_reader import READ_BATCH_BYTES, layout_of, read_checked_metadata, tensor_layouts
from .planner import decode_value

_Item = tuple[MetadataIndex, int, int]  # (index, offset, length) in one file


def export_dcp(
    store: ObjectStore,
    manifest: Manifest,
    out_dir: str | os.PathLike[str],
    *,
    progress: Callable[[int], None] | None = None,
    trust_pickled_values: bool = False,
) -> Path:
    step = manifest.step
    check_manifest(manifest)
    reader = ChunkReader(store, manifest)
    metadata = read_checked_metadata(reader)
    by_file: dict[str, list[_Item]] = {}
    for index, value in metadata.storage_data.items():
        where = storage_location(value)
        assert where is not None  # read_checked_metadata saw to it
        name, offset, length = where
        by_file.setdefault(check_file_name(name, step=step), []).append((index, offset, length))
    if not trust_pickled_values:
        _check_values(reader, metadata, by_file, step)

    out = empty_directory(out_dir)
    written: list[Path] = []
    try:
        storage = _write_data_files(reader, metadata, by_file, out, written, progress)
        exported = dataclasses.replace(metadata, storage_data=storage, storage_meta=None)
        with _create(out, METADATA_FILE, written) as f:
            f.write(pickle.dumps(exported))
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return out


def _check_values(
    reader: ChunkReader, metadata: Metadata, by_file: dict[str, list[_Item]], step: int
) -> None:
    """Every non-tensor value loads by weights_only rules (stock DCP would unpickle it)."""
    values = [
        (name, index, offset, length)
        for name, items in by_file.items()
        for index, offset, length in items
        if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
    ]
    datas = reader.read_ranges([(name, off, off + n) for name, _, off, n in values])
    for (_, index, _, _), data in zip(values, datas, strict=True):
        decode_value(data, step=step, fqn=index.fqn, trusted=False)


def _write_data_files(
    reader: ChunkReader,
    metadata: Metadata,
    by_file: dict[str, list[_Item]],
    out: Path,
    written: list[Path],
    progress: Callable[[int], None] | None,
) -> dict[MetadataIndex, _StorageInfo]:
    layouts = tensor_layouts(metadata)
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for name, items in sorted(by_file.items()):
        items.sort(key=lambda i: i[1])
        with _create(out, name, written) as f:
            for batch in _batches(items):
                datas = reader.read_ranges([(name, off, off + n) for _, off, n in batch])
                for (index, _, _), raw in zip(batch, datas, strict=True):
                    md = metadata.state_dict_metadata[index.fqn]
                    body: bytes | memoryview
                    if isinstance(md, BytesStorageMetadata):
                        body = raw
                    else:
                        layout = layout_of(layouts, index)
                        tensor = torch.frombuffer(bytearray(raw), dtype=layout.dtype)
                        buf = io.BytesIO()
                        torch.save(tensor.view(layout.sizes), buf)
                        body = buf.getvalue()
                    storage[index] = _StorageInfo(name, f.tell(), len(body))
                    f.write(body)
                    if progress:
                        progress(len(raw))
    return storage


def empty_directory(out_dir: str | os.PathLike[str]) -> Path:
    """``out_dir``, created if new; one that holds anything is refused (an export writes
    only new files, and never beside a previous export's or the user's own)."""
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
        with os.scandir(out) as entries:
            taken = next((e.name for e in entries), None)
    except OSError as exc:
        raise CheckpointError(
            f"cannot export into {out}: {exc.strerror}; choose a writable directory"
        ) from None
    if taken is not None:
        raise CheckpointError(
            f"export directory {out} is not empty (it holds {taken!r}): an export never "
            "overwrites; give an empty or new directory, or remove what is there first"
        )
    return out


def _create(out: Path, name: str, written: list[Path]) -> BinaryIO:
    """A new file of a plain name inside ``out``: created exclusively (O_EXCL: a file
    already there, or a link in its place, is never written through or truncated)."""
    path = out / name
    if path.parent != out or path.name != name:
        raise AssertionError(f"{name!r} is not a plain file name")  # check_file_name's job
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        raise CheckpointError(
            f"{path} already exists (written there during the export?): an export never "
            "overwrites; export again into an empty or new directory"
        ) from None
    written.append(path)
    return os.fdopen(fd, "wb")


def _batches(items: list[_Item]) -> list[list[_Item]]:
    batches: list[list[_Item]] = [[]]
    size = 0
    for item in items:
        if size >= READ_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[2]
    return [b for b in batches if b]


def check_new_file(out_file: str | os.PathLike[str]) -> Path:
    """``out_file`` if nothing is there yet (checked before an export's long work)."""
    path = Path(out_file)
    if os.path.lexists(path):
        raise CheckpointError(
            f"{path} already exists: an export never overwrites; name a new file, or remove "
            "that one first"
        )
    return path


def export_torch_save(dcp_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> None:
    """One ``torch.save`` file of the full (unsharded) state, for inference.

    Written under a temporary name beside it, then linked into place: link(2) refuses a
    name that exists, so a file that is there is never replaced, and none is half-written.

    Stock DCP reads the directory (values with full pickle): run it only on a directory
    ``export_dcp`` wrote, whose values passed weights_only (or that you trust).
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    path = check_new_file(out_file)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        dcp_to_torch_save(dcp_dir, tmp)
        os.link(tmp, path)
    except FileExistsError:
        raise CheckpointError(
            f"{path} appeared during the export: an export never overwrites; name a new file"
        ) from None
    finally:
        tmp.unlink(missing_ok=True)
