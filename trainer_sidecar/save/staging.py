"""Staging slots: reusable memory-backed buffers between the trainer and the sidecar.

A save copies the state once, into a slot: a file in a memory-backed directory
(/dev/shm locally, an emptyDir with medium Memory in a pod) that stays mapped
between saves, so after the first save the copy lands in already-touched pages.
The trainer writes the slot's data, then ``ready.json`` (atomically) last;
the slot is busy until the persister has uploaded it and removed ``ready.json``.
A trainer killed mid-copy leaves no ``ready.json``: the slot is simply free.

    <root>/state.json                     latest commit, written by rank 0's persister
    <root>/rank-<r>/slot-<k>/__<r>_0.distcp   raw tensor bytes, kept mapped (see dcp_storage)
    <root>/rank-<r>/slot-<k>/__<r>_1.distcp   non-tensor values (DCP's byte streams)
    <root>/rank-<r>/slot-<k>/.metadata        DCP metadata (coordinator's slot only)
    <root>/rank-<r>/slot-<k>/ready.json       the staged checkpoint's description

With one slot per rank (the default) host memory stays at one copy of the
rank's state; a save that finds its slot still uploading waits or is skipped.
"""

from __future__ import annotations

import dataclasses
import io
import json
import mmap
import os
import pickle
import shutil
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format.chunking import Span
from ..format.manifest import METADATA_FILE, rank_file_name
from ..format.policy import Committed
from ..format.policy import SavePlan as CkptPlan

READY = "ready.json"
STATE = "state.json"


@dataclasses.dataclass(frozen=True, slots=True)
class StagedCheckpoint:
    """ready.json: everything the persister needs, nothing the trainer must still do."""

    step: int
    rank: int
    world_size: int
    plan: CkptPlan
    files: tuple[tuple[str, tuple[Span, ...]], ...]  # (file name in slot, item extents)
    staged_at: float  # wall clock, for the end-to-end latency metric
    stage_seconds: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "world_size": self.world_size,
                "plan": dataclasses.asdict(self.plan),
                "files": [[n, [[s.offset, s.length] for s in items]] for n, items in self.files],
                "staged_at": self.staged_at,
                "stage_seconds": self.stage_seconds,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> StagedCheckpoint:
        raw = json.loads(text)
        return cls(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            world_size=int(raw["world_size"]),
            plan=CkptPlan(**raw["plan"]),
            files=tuple(
                (str(n), tuple(Span(o, ln) for o, ln in items)) for n, items in raw["files"]
            ),
            staged_at=float(raw["staged_at"]),
            stage_seconds=float(raw["stage_seconds"]),
        )


def rank_dir(root: Path, rank: int) -> Path:
    return root / f"rank-{rank}"


def slot_dirs(root: Path, rank: int, count: int) -> list[Path]:
    return [rank_dir(root, rank) / f"slot-{k}" for k in range(count)]


def free_slot(root: Path, rank: int, count: int) -> Path | None:
    for slot in slot_dirs(root, rank, count):
        if not (slot / READY).exists():
            return slot
    return None


def wait_free_slot(root: Path, rank: int, count: int, timeout_s: float) -> Path | None:
    """Poll (1 ms growing to 50 ms) until a slot frees up or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    delay = 0.001
    while True:
        slot = free_slot(root, rank, count)
        if slot is not None or time.monotonic() >= deadline:
            return slot
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def remove_rank(root: Path, rank: int) -> None:
    """Free a rank's staging buffers (unmapped first)."""
    directory = rank_dir(root, rank)
    with _MAPS_LOCK:
        for path in [p for p in _MAPS if directory in p.parents]:
            _MAPS.pop(path).close()
    shutil.rmtree(directory, ignore_errors=True)


def mark_ready(slot: Path, staged: StagedCheckpoint) -> None:
    tmp = slot / (READY + ".tmp")
    tmp.write_text(staged.to_json())
    os.replace(tmp, slot / READY)


def release(slot: Path) -> None:
    (slot / READY).unlink(missing_ok=True)


def pending(root: Path, rank: int | None = None) -> list[tuple[Path, StagedCheckpoint]]:
    """Staged, not yet uploaded checkpoints under root (of one rank, or all), oldest first."""
    found = []
    ranks = "*" if rank is None else str(rank)
    for ready in root.glob(f"rank-{ranks}/slot-*/{READY}"):
        try:
            found.append((ready.parent, StagedCheckpoint.from_json(ready.read_text())))
        except (FileNotFoundError, json.JSONDecodeError, KeyError):
            continue  # released meanwhile
    return sorted(found, key=lambda p: (p[1].step, p[1].rank))


def write_state(root: Path, committed: Committed, uri: str) -> None:
    tmp = root / (STATE + ".tmp")
    tmp.write_text(json.dumps({"uri": uri, **dataclasses.asdict(committed)}))
    os.replace(tmp, root / STATE)


def read_state(root: Path, uri: str) -> Committed | None:
    try:
        raw = json.loads((root / STATE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if raw.pop("uri", None) != uri:
        return None
    return Committed(**raw)


class _MappedFile:
    """A file kept mapped across saves; resized (and remapped) only when the layout changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.size = -1
        self.map: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None

    def ensure(self, size: int) -> torch.Tensor:
        if size != self.size or not self.path.exists():
            self.close()
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a+b") as f:
                f.truncate(size)
                if size:
                    self.map = mmap.mmap(f.fileno(), size)
            self.tensor = (
                torch.frombuffer(self.map, dtype=torch.uint8)
                if self.map
                else torch.empty(0, dtype=torch.uint8)
            )
            self.size = size
        assert self.tensor is not None
        return self.tensor

    def close(self) -> None:
        self.tensor = None
        if self.map is not None:
            try:
                self.map.close()
            except BufferError:  # a view is still alive; the GC will unmap it
                pass
            self.map = None
        self.size = -1


_MAPS: dict[Path, _MappedFile] = {}
_MAPS_LOCK = threading.Lock()


def mapped(path: Path) -> _MappedFile:
    with _MAPS_LOCK:
        if path not in _MAPS:
            _MAPS[path] = _MappedFile(path)
        return _MAPS[path]


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return (t if t.is_contiguous() else t.contiguous()).reshape(-1)


def _copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into the uint8 ``dst``, typed where aligned (the faster kernel)."""
    if dst.storage_offset() % src.element_size() == 0:
        dst.view(src.dtype).copy_(src)
    else:
        dst.copy_(src.view(torch.uint8))


StagedFiles = list[tuple[str, tuple[Span, ...]]]  # (file name in the slot, item extents)


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
    """
    sources = []
    for item in tensor_items:
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        sources.append(_flat(data))
    sizes = [t.numel() * t.element_size() for t in sources]
    name = rank_file_name(rank, 0)
    buffer = mapped(slot / name).ensure(sum(sizes))
    results, extents, offset = [], [], 0
    for item, source, size in zip(tensor_items, sources, sizes, strict=True):
        if size:
            _copy_into(buffer[offset : offset + size], source)
        results.append(WriteResult(item.index, size, (name, offset, size)))
        extents.append(Span(offset, size))
        offset += size
    files: StagedFiles = [(name, tuple(extents))]
    if byte_items:
        blobs = serialize_bytes(byte_items, planner) if blobs is None else blobs
        written = byte_results(rank, byte_items, blobs)
        with open(slot / rank_file_name(rank, 1), "wb") as f:
            for blob in blobs:
                f.write(blob)
        results += written
        files.append((rank_file_name(rank, 1), tuple(Span(*r.storage_data[1:]) for r in written)))
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
