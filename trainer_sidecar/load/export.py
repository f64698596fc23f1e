"""Export a committed checkpoint as a plain DCP directory (and optionally one file).

The result is what ``torch.distributed.checkpoint.FileSystemWriter`` would have
written: each tensor serialized with ``torch.save`` at the offsets recorded in
``.metadata``, so stock ``torch.distributed.checkpoint.load`` (FileSystemReader)
reads it with no ctj installed. Every byte is hash-verified on the way.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from ..format.manifest import METADATA_FILE, Manifest
from ..store.base import ObjectStore
from .chunk_reader import ChunkReader
from .dcp_reader import READ_BATCH_BYTES, layout_of, tensor_layouts


def export_dcp(
    store: ObjectStore,
    manifest: Manifest,
    out_dir: str | os.PathLike[str],
    *,
    progress: Callable[[int], None] | None = None,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    reader = ChunkReader(store, manifest)
    metadata: Metadata = pickle.loads(reader.read_file(METADATA_FILE))
    layouts = tensor_layouts(metadata)
    by_file: dict[str, list[tuple[object, int, int]]] = {}
    for index, (path, offset, length) in metadata.storage_data.items():
        by_file.setdefault(str(path), []).append((index, int(offset), int(length)))

    storage: dict[object, _StorageInfo] = {}
    for name, items in sorted(by_file.items()):
        items.sort(key=lambda i: i[1])
        with open(out / name, "wb") as f:
            for batch in _batches(items):
                datas = reader.read_ranges([(name, off, off + n) for _, off, n in batch])
                for (index, _, _), raw in zip(batch, datas, strict=True):
                    md = metadata.state_dict_metadata[index.fqn]  # type: ignore[attr-defined]
                    if isinstance(md, BytesStorageMetadata):
                        body = raw
                    else:
                        layout = layout_of(layouts, index)  # type: ignore[arg-type]
                        tensor = torch.frombuffer(bytearray(raw), dtype=layout.dtype)
                        buf = io.BytesIO()
                        torch.save(tensor.view(layout.sizes), buf)
                        body = buf.getvalue()
                    storage[index] = _StorageInfo(name, f.tell(), len(body))
                    f.write(body)
                    if progress:
                        progress(len(raw))
    metadata.storage_data = storage
    (out / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    return out


def _batches(items: list[tuple[object, int, int]]) -> list[list[tuple[object, int, int]]]:
    batches: list[list[tuple[object, int, int]]] = [[]]
    size = 0
    for item in items:
        if size >= READ_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(item)
        size += item[2]
    return [b for b in batches if b]


def export_torch_save(dcp_dir: str | os.PathLike[str], out_file: str | os.PathLike[str]) -> None:
    """One ``torch.save`` file of the full (unsharded) state, for inference."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_dir, out_file)
