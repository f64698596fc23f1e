"""The checkpoint format: object keys, chunk references, the per-step manifest.

Format ``ctj-checkpoint`` version 1 (docs/format.md is the reference):

    chunks/<id[:2]>/<id>[.zst]       content-addressed chunk, stored once
    parts/<step>/rank-<r>.json       one rank's uploaded file list (pre-commit)
    manifests/<step>.json            the commit: a checkpoint exists iff this does
    retired/<step>.json              a removed checkpoint's manifest, kept for the gc grace

A manifest names every chunk of every file of its checkpoint, so a restore
never walks a delta chain, and deleting any other checkpoint cannot break it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

FORMAT = "ctj-checkpoint"
FORMAT_VERSION = 1
METADATA_FILE = ".metadata"
MODES = ("full", "incremental", "differential")

MANIFESTS = "manifests/"
RETIRED = "retired/"
PARTS = "parts/"
CHUNKS = "chunks/"


def manifest_key(step: int) -> str:
    return f"{MANIFESTS}{step:020d}.json"


def retired_key(step: int) -> str:
    return f"{RETIRED}{step:020d}.json"


def step_of_manifest_key(key: str) -> int | None:
    """The step of a ``manifests/`` or ``retired/`` key (None for anything else)."""
    name = key.rsplit("/", 1)[-1]
    if not key.startswith((MANIFESTS, RETIRED)) or not name.endswith(".json"):
        return None
    try:
        return int(name[: -len(".json")])
    except ValueError:
        return None


def part_prefix(step: int) -> str:
    return f"{PARTS}{step:020d}/"


def part_key(step: int, rank: int) -> str:
    return f"{part_prefix(step)}rank-{rank:05d}.json"


def chunk_key(chunk_id: str, codec: str) -> str:
    suffix = ".zst" if codec == "zstd" else ""
    return f"{CHUNKS}{chunk_id[:2]}/{chunk_id}{suffix}"


def rank_file_name(rank: int, index: int = 0) -> str:
    """A rank's data files: 0 holds its tensors, 1 its non-tensor values (if any)."""
    return f"__{rank}_{index}.distcp"


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRef:
    id: str
    size: int  # raw bytes
    stored_size: int  # bytes in the store (compressed size for zstd)
    codec: str  # "none" | "zstd"
    blocks: tuple[str, ...]  # hex BLAKE3 of each block_size block of the raw bytes

    @property
    def key(self) -> str:
        return chunk_key(self.id, self.codec)

    def to_json(self) -> list[Any]:
        return [self.id, self.size, self.stored_size, self.codec, list(self.blocks)]

    @classmethod
    def from_json(cls, raw: list[Any]) -> ChunkRef:
        cid, size, stored, codec, blocks = raw
        return cls(str(cid), int(size), int(stored), str(codec), tuple(blocks))


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """One DCP file of the checkpoint as an ordered list of chunks."""

    size: int
    chunks: tuple[ChunkRef, ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FileEntry:
        return cls(int(raw["size"]), tuple(ChunkRef.from_json(c) for c in raw["chunks"]))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    step: int
    mode: str
    parent_step: int | None  # the previous committed checkpoint when this one was planned
    base_step: int  # the last full checkpoint this one's deltas are against (itself if full)
    since_full: int  # checkpoints since the last full one (0 for a full one)
    world_size: int
    block_size: int
    files: dict[str, FileEntry]
    logical_bytes: int
    uploaded_bytes: int
    deduplicated_bytes: int
    created: float
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)

    def chunk_ids(self) -> set[str]:
        return {c.id for f in self.files.values() for c in f.chunks}

    def chunk_keys(self) -> set[str]:
        return {c.key for f in self.files.values() for c in f.chunks}

    def to_bytes(self) -> bytes:
        body = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "mode": self.mode,
            "parent_step": self.parent_step,
            "base_step": self.base_step,
            "since_full": self.since_full,
            "world_size": self.world_size,
            "block_size": self.block_size,
            "logical_bytes": self.logical_bytes,
            "uploaded_bytes": self.uploaded_bytes,
            "deduplicated_bytes": self.deduplicated_bytes,
            "created": self.created,
            "timings": self.timings,
            "versions": self.versions,
            "files": {name: f.to_json() for name, f in sorted(self.files.items())},
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        raw = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ValueError("not a ctj checkpoint manifest")
        if int(raw.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(
                f"manifest format version {raw['version']} is newer than this ctj "
                f"understands ({FORMAT_VERSION}): upgrade ctj"
            )
        return cls(
            step=int(raw["step"]),
            mode=str(raw["mode"]),
            parent_step=raw["parent_step"],
            base_step=int(raw["base_step"]),
            since_full=int(raw["since_full"]),
            world_size=int(raw["world_size"]),
            block_size=int(raw["block_size"]),
            files={k: FileEntry.from_json(v) for k, v in raw["files"].items()},
            logical_bytes=int(raw["logical_bytes"]),
            uploaded_bytes=int(raw["uploaded_bytes"]),
            deduplicated_bytes=int(raw["deduplicated_bytes"]),
            created=float(raw["created"]),
            timings={k: float(v) for k, v in raw.get("timings", {}).items()},
            versions={k: str(v) for k, v in raw.get("versions", {}).items()},
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """What one rank uploaded for a step, written before the commit."""

    step: int
    rank: int
    files: dict[str, FileEntry]
    uploaded_bytes: int
    deduplicated_bytes: int
    upload_seconds: float

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "files": {n: f.to_json() for n, f in self.files.items()},
                "uploaded_bytes": self.uploaded_bytes,
                "deduplicated_bytes": self.deduplicated_bytes,
                "upload_seconds": self.upload_seconds,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankPart:
        raw = json.loads(data)
        return cls(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            files={k: FileEntry.from_json(v) for k, v in raw["files"].items()},
            uploaded_bytes=int(raw["uploaded_bytes"]),
            deduplicated_bytes=int(raw["deduplicated_bytes"]),
            upload_seconds=float(raw["upload_seconds"]),
        )
