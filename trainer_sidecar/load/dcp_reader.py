"""The DCP read side: a StorageReader over a committed manifest.

Checkpoints hold raw little-endian tensor bytes (staging.StagingWriter writes
them), not pickles. That is what makes resharded loads cheap: a new rank that
needs rows [a, b) of a saved shard reads exactly those bytes.

DCP's planner decides what each rank needs (resharding included); we turn
every ReadItem into a byte range, fetch all of a plan's ranges in parallel,
verified, and copy them into place.

The per-item storage data is a plain ``(relative_path, offset, length)`` tuple,
so a checkpoint's metadata never depends on our class names.

``.metadata`` is untrusted (whoever can write the bucket wrote it): it is
unpickled by safe_pickle's allow-list and checked against the manifest before
anything in it is used. ``restore`` reads it once, on rank 0, and hands every
rank the checked object; read standalone, the reader does the same itself.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import sys
import warnings
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
)
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import UnsafeCheckpointError
from ..format.manifest import MAX_METADATA_BYTES, METADATA_FILE
from .checks import check_metadata, check_pickle, storage_location
from .chunk_reader import ChunkReader
from .safe_pickle import load_metadata

READ_BATCH_BYTES = 256 << 20  # bound on bytes fetched but not yet copied, per rank


@dataclasses.dataclass(frozen=True, slots=True)
class TensorLayout:
    dtype: torch.dtype
    sizes: tuple[int, ...]  # of the saved chunk


def tensor_layouts(metadata: Metadata) -> dict[MetadataIndex, TensorLayout]:
    """dtype and shape of every saved tensor chunk, by its metadata index."""
    layouts = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            for i, chunk in enumerate(md.chunks):
                layouts[MetadataIndex(fqn, chunk.offsets, i)] = TensorLayout(
                    md.properties.dtype, tuple(chunk.sizes)
                )
    return layouts


def layout_of(layouts: dict[MetadataIndex, TensorLayout], index: MetadataIndex) -> TensorLayout:
    found = layouts.get(index)
    if found is None:  # the index hint may differ; match on fqn and offsets
        found = next(
            lay
            for key, lay in layouts.items()
            if key.fqn == index.fqn and key.offset == index.offset
        )
    return found


def read_checked_metadata(reader: ChunkReader) -> Metadata:
    """The checkpoint's DCP metadata: at most MAX_METADATA_BYTES, fetched verified, its
    counts checked against its own bytes (checks.check_pickle), unpickled by the
    allow-list, and checked against its manifest. Raises CorruptCheckpointError
    (UnsafeCheckpointError among them) for a checkpoint that has none, or one that is
    unusable."""
    manifest = reader.manifest
    if METADATA_FILE not in manifest.files:
        raise UnsafeCheckpointError(manifest.step, METADATA_FILE, "is missing from the manifest")
    size = manifest.file_sizes()[METADATA_FILE]
    if size > MAX_METADATA_BYTES:
        raise UnsafeCheckpointError(
            manifest.step, METADATA_FILE, f"is {size} bytes, more than {MAX_METADATA_BYTES}"
        )
    data = reader.read_file(METADATA_FILE)
    check_pickle(data, step=manifest.step)
    metadata = load_metadata(data, step=manifest.step)
    sizes = {n: size for n, size in manifest.file_sizes().items() if n != METADATA_FILE}
    check_metadata(metadata, step=manifest.step, file_sizes=sizes)
    return metadata


class ChunkedStorageReader(StorageReader):
    """Reads a committed checkpoint through a ChunkReader (ranged, verified GETs).

    ``metadata``: the checkpoint's, already checked (read_checked_metadata); None
    reads and checks it here.
    """

    def __init__(self, reader: ChunkReader, *, metadata: Metadata | None = None) -> None:
        super().__init__()
        self.reader = reader
        self.metadata = metadata

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata is None:
            self.metadata = read_checked_metadata(self.reader)
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.metadata = metadata
        self.layouts = tensor_layouts(metadata)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def _location(self, item: ReadItem) -> tuple[str, int, int]:
        assert self.metadata is not None
        where = storage_location(self.metadata.storage_data[item.storage_index])
        assert where is not None  # check_metadata saw to it
        return where

    def _layout(self, item: ReadItem) -> TensorLayout:
        return layout_of(self.layouts, item.storage_index)

    def _byte_range(self, item: ReadItem) -> tuple[str, int, int, tuple[int, ...]]:
        """The contiguous bytes holding the requested rows, and their shape."""
        path, offset, length = self._location(item)
        if item.type == LoadItemType.BYTE_IO:
            return path, offset, offset + length, ()
        layout = self._layout(item)
        if not layout.sizes:
            return path, offset, offset + length, ()
        itemsize = torch.empty((), dtype=layout.dtype).element_size()
        row = math.prod(layout.sizes[1:]) * itemsize
        first, rows = item.storage_offsets[0], item.lengths[0]
        start = offset + first * row
        return path, start, start + rows * row, (rows, *layout.sizes[1:])

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        batch: list[tuple[ReadItem, tuple[str, int, int, tuple[int, ...]]]] = []
        pending = 0
        for item in sorted(plan.items, key=self._location):
            rng = self._byte_range(item)
            batch.append((item, rng))
            pending += rng[2] - rng[1]
            if pending >= READ_BATCH_BYTES:
                self._read_batch(batch, planner)
                batch, pending = [], 0
        if batch:
            self._read_batch(batch, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_batch(
        self,
        batch: list[tuple[ReadItem, tuple[str, int, int, tuple[int, ...]]]],
        planner: LoadPlanner,
    ) -> None:
        targets = [
            None if item.type == LoadItemType.BYTE_IO else planner.resolve_tensor(item).detach()
            for item, _ in batch
        ]
        in_place = [
            None if target is None else self._in_place(item, target, b - a)
            for (item, (_, a, b, _)), target in zip(batch, targets, strict=True)
        ]
        datas = self.reader.read_ranges([(p, a, b) for _, (p, a, b, _) in batch], into=in_place)
        for (item, (_, _, _, shape)), target, buf, data in zip(
            batch, targets, in_place, datas, strict=True
        ):
            if target is None:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            if target.numel() and buf is None:  # not read into place: copy (and cast) it there
                dtype = self._layout(item).dtype
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # read-only buffer: we only read
                    src = torch.frombuffer(data, dtype=dtype).view(shape or target.shape)
                for dim in range(1, len(shape)):
                    src = src.narrow(dim, item.storage_offsets[dim], item.lengths[dim])
                target.copy_(src.reshape(target.shape))
            planner.commit_tensor(item, target)

    def _in_place(self, item: ReadItem, target: torch.Tensor, nbytes: int) -> memoryview | None:
        """The target's own bytes, when the saved bytes can be written there as they are:
        a CPU tensor, contiguous, of the saved dtype, taking whole saved rows. Then the
        load copies each byte once, from the response into the tensor; otherwise
        (a GPU tensor, a cast, a column slice) it goes through ``copy_``."""
        layout = self._layout(item)
        whole_rows = all(
            item.storage_offsets[d] == 0 and item.lengths[d] == layout.sizes[d]
            for d in range(1, len(layout.sizes))
        )
        if not (
            whole_rows
            and target.numel()
            and target.device.type == "cpu"
            and target.dtype == layout.dtype
            and target.is_contiguous()
            and target.numel() * target.element_size() == nbytes
            and sys.byteorder == "little"  # saved bytes are little-endian
        ):
            return None
        return target.view(-1).view(torch.uint8).numpy().data

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True
