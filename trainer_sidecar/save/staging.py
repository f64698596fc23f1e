"""The one copy of a save: a rank's state into its staging slot (see slots.py).

Each slot's tensor file stays mapped between saves, so after the first save the
copy lands in already-touched pages; it is allocated up front (fallocate), so a
staging volume that is full gives a CheckpointError at the save, never a SIGBUS
in the middle of the copy. ``StagingWriter`` is the DCP StorageWriter that
plans a save into a slot; ``stage_items`` copies in an already planned layout.

With one slot per rank (the default) host memory stays at one copy of the
rank's state; a save that finds its slot still uploading waits or is skipped.
"""

from __future__ import annotations

import dataclasses
import errno
import io
import mmap
import os
import pickle
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import CheckpointError
from ..format.chunking import Span
from ..format.manifest import METADATA_FILE, rank_file_name
from . import device, slots


class _MappedFile:
    """A file kept mapped across saves; resized (and remapped) only when the layout changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = -1
        self.map: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        self.pinned = False  # registered with CUDA for copies from a GPU (see device.py)
        self._pin_tried = False

    def ensure(self, size: int) -> torch.Tensor:
        if size != self.size or not self.path.exists():
            self.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as f:
                f.truncate(size)
                if size:
                    _allocate(f.fileno(), size, self.path)
                    self.map = mmap.mmap(f.fileno(), size)
            self.tensor = (
                torch.frombuffer(self.map, dtype=torch.uint8)
                if self.map
                else torch.empty(0, dtype=torch.uint8)
            )
            self.size = size
        assert self.tensor is not None
        return self.tensor

    def pin(self) -> bool:
        """Page-lock the mapping for copies from a GPU: once per mapping, on first use."""
        if not self._pin_tried and self.map is not None and self.tensor is not None:
            self._pin_tried = True
            self.pinned = device.register(self.tensor.data_ptr(), self.size)
        return self.pinned

    def close(self) -> None:
        if self.pinned and self.tensor is not None:  # unpinned before it is unmapped
            device.unregister(self.tensor.data_ptr())
        self.pinned = self._pin_tried = False
        self.tensor = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive; the GC will unmap it
                pass
            self.map = None
        self.size = -1


def _allocate(fd: int, size: int, path: Path) -> None:
    """Reserve the slot's pages now: on a full tmpfs a write into a mapping is a SIGBUS."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise CheckpointError(
                f"the staging volume has no room for {size:,} bytes at {path.parent}: give it "
                "more (the pod's staging emptyDir sizeLimit, or /dev/shm), or use fewer "
                "staging_slots"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it
            raise


_MAPS: dict[Path, _MappedFile] = {}
_MAPS_LOCK = threading.Lock()


def unmap_rank(root: Path, rank: int) -> None:
    """Close this process's mappings of a rank's slots (the files stay)."""
    directory = slots.rank_dir(root, rank)
    with _MAPS_LOCK:
        for path in [p for p in _MAPS if directory in p.parents]:
            _MAPS.pop(path).close()


def remove_rank(root: Path, rank: int) -> None:
    """Free a rank's staging buffers: unmapped first, then deleted."""
    unmap_rank(root, rank)
    slots.remove_rank_dir(root, rank)


def mapped(path: Path) -> _MappedFile:
    with _MAPS_LOCK:
        if path not in _MAPS:
            _MAPS[path] = _MappedFile(path)
        return _MAPS[path]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)


def _copy_into(dst: torch.Tensor, src: torch.Tensor, *, non_blocking: bool = False) -> None:
    """Copy ``src``'s bytes into the uint8 ``dst``, typed where aligned (the faster kernel).
    ``non_blocking`` (a GPU source) only issues the copy: the caller synchronises."""
    if dst.storage_offset() % src.element_size() == 0:
        dst.view(src.dtype).copy_(src, non_blocking=non_blocking)
    else:
        dst.copy_(src.view(torch.uint8), non_blocking=non_blocking)


StagedFiles = list[tuple[str, tuple[Span, ...]]]  # (file name in the slot, item extents)
BYTES = "bytes"  # the dtype recorded for a non-tensor value (DCP's byte stream)


def dtype_name(dtype: torch.dtype) -> str:
    """A tensor dtype as the persister sees it (it has no torch): "float32", "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def file_order(items: Sequence[WriteItem]) -> tuple[tuple[WriteItem, ...], tuple[WriteItem, ...]]:
    """(tensor items, byte items), each in file order: by name, so a layout is reproducible."""
    ordered = sorted(items, key=lambda i: str(i.index))
    return (
        tuple(i for i in ordered if i.type != WriteItemType.BYTE_IO),
        tuple(i for i in ordered if i.type == WriteItemType.BYTE_IO),
    )


def serialize_bytes(items: Sequence[WriteItem], planner: SavePlanner) -> list[memoryview]:
    """The byte items' values as DCP serializes them (torch.save), in order."""
    out = []
    for item in items:
        data = planner.resolve_data(item)
        assert isinstance(data, io.BytesIO)
        out.append(data.getbuffer())
    return out


def byte_results(
    rank: int, items: Sequence[WriteItem], blobs: Sequence[memoryview]
) -> list[WriteResult]:
    """Where each byte item lands: end to end in the rank's second data file."""
    name, offset, results = rank_file_name(rank, 1), 0, []
    for item, blob in zip(items, blobs, strict=True):
        results.append(WriteResult(item.index, blob.nbytes, (name, offset, blob.nbytes)))
        offset += blob.nbytes
    return results


def stage_items(
    slot: Path,
    rank: int,
    tensor_items: Sequence[WriteItem],
    byte_items: Sequence[WriteItem],
    planner: SavePlanner,
    blobs: Sequence[memoryview] | None = None,
) -> tuple[list[WriteResult], StagedFiles]:
    """The one copy of a save: tensors into the slot's mapped file, then the small values.

    Tensors go end to end into ``__<r>_0.distcp``, which stays mapped (and its pages
    touched) while their layout holds; non-tensor values, whose size changes from save
    to save (a step counter), go to ``__<r>_1.distcp``, so they never move a tensor.
    Tensors on a GPU are copied into the pinned mapping without blocking, and waited
    for before this returns (device.py); CPU tensors never touch CUDA.
    """
    sources = []
    for item in tensor_items:
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        sources.append(_flat(data))
    sizes = [t.numel() * t.element_size() for t in sources]
    name = rank_file_name(rank, 0)
    target = mapped(slot / name)
    buffer = target.ensure(sum(sizes))
    gpus = device.cuda_devices(sources)  # empty on CPU: no CUDA call below
    if gpus:
        target.pin()
    results, extents, offset = [], [], 0
    try:
        for item, source, size in zip(tensor_items, sources, sizes, strict=True):
            if size:
                _copy_into(buffer[offset : offset + size], source, non_blocking=source.is_cuda)
            results.append(WriteResult(item.index, size, (name, offset, size)))
            extents.append(Span(offset, size, dtype_name(source.dtype)))
            offset += size
    finally:  # every GPU copy landed (also on an error: none may write into a remapped slot)
        if gpus:
            device.synchronize(gpus)
    files: StagedFiles = [(name, tuple(extents))]
    if byte_items:
        blobs = serialize_bytes(byte_items, planner) if blobs is None else blobs
        written = byte_results(rank, byte_items, blobs)
        with open(slot / rank_file_name(rank, 1), "wb") as f:
            for blob in blobs:
                f.write(blob)
        results += written
        values = tuple(Span(r.storage_data[1], r.storage_data[2], BYTES) for r in written)
        files.append((rank_file_name(rank, 1), values))
    return results, files


def write_metadata(slot: Path, blob: bytes) -> None:
    """The coordinator's ``.metadata`` (DCP's pickled Metadata), replaced atomically."""
    tmp = slot / (METADATA_FILE + ".tmp")
    tmp.write_bytes(blob)
    os.replace(tmp, slot / METADATA_FILE)


class StagingWriter(StorageWriter):
    """DCP StorageWriter that copies each rank's items into its slot, raw and end to end.

    Call order (DCP's): set_up_storage_writer, prepare_local_plan, [coordinator]
    prepare_global_plan, write_data, [coordinator] finish. ``write_data`` does the
    one copy (``stage_items``); ``finish`` writes ``.metadata``. What DCP decided is
    kept on the writer for the next save to reuse (``local_items``, ``tensor_items``,
    ``byte_items``, ``metadata``), and the staged files with their item extents
    (``files``) for the uploader's chunk alignment.
    """

    def __init__(self, slot: str | os.PathLike[str]) -> None:
        super().__init__()
        self.slot = Path(slot)
        self.rank = 0
        self.local_items: tuple[WriteItem, ...] = ()
        self.tensor_items: tuple[WriteItem, ...] = ()
        self.byte_items: tuple[WriteItem, ...] = ()
        self.files: StagedFiles = []
        self.metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.slot = Path(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.slot.mkdir(parents=True, exist_ok=True)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self.local_items = tuple(plan.items)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.rank = int(plan.storage_data)
        self.tensor_items, self.byte_items = file_order(plan.items)
        results, self.files = stage_items(
            self.slot, self.rank, self.tensor_items, self.byte_items, planner
        )
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        write_metadata(self.slot, pickle.dumps(metadata))
        self.metadata = metadata

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return True

    def storage_meta(self) -> None:
        return None
