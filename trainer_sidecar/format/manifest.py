"""The checkpoint format: object keys, chunk references, the per-step manifest.

Format ``ctj-checkpoint`` version 2 (docs/format.md is the reference):

    chunks/<id[:2]>/<id>[.zst]            content-addressed chunk, stored once
    parts/<step>/<save>/rank-<r>.json     one rank's uploaded file list (pre-commit)
    parts/<step>/<save>/<who>.failed      a rank's (or the commit's) failure, for the others
    manifests/<step>.json                 the commit: a checkpoint exists iff this does
    retired/<step>.json                   a removed checkpoint's manifest, kept for the gc grace

``<save>`` is the save's identity (attempt and a nonce rank 0 chose): a commit
takes exactly the parts of ranks 0..W-1 of one save, so nothing another attempt,
a straggler or a second writer left can enter it. A manifest names every chunk
of every file of its checkpoint, so a restore never walks a delta chain, and
deleting any other checkpoint cannot break it. Version 1 (parts directly under
``parts/<step>/``, no identity in the manifest) is still read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import secrets
from typing import Any

FORMAT = "ctj-checkpoint"
FORMAT_VERSION = 2
METADATA_FILE = ".metadata"


class Mode(enum.StrEnum):
    FULL = "full"
    INCREMENTAL = "incremental"  # chunks the previous checkpoint names are not sent again
    DIFFERENTIAL = "differential"  # chunks the last full checkpoint names are not sent again


class Codec(enum.StrEnum):
    """How a chunk is stored (format/codecs.py encodes and decodes; docs/format.md)."""

    NONE = "none"  # chunks/<id>: the raw bytes
    ZSTD = "zstd"  # chunks/<id>.zst: one zstd frame
    ZSTD_BP2 = "zstd-bp2"  # chunks/<id>.bp2.zst: 2 byte planes (bf16, fp16), a frame each
    ZSTD_BP4 = "zstd-bp4"  # chunks/<id>.bp4.zst: 4 byte planes (fp32), a frame each


_SUFFIX = {
    Codec.NONE: "",
    Codec.ZSTD: ".zst",
    Codec.ZSTD_BP2: ".bp2.zst",
    Codec.ZSTD_BP4: ".bp4.zst",
}


MODES = tuple(m.value for m in Mode)
_ATTEMPT = re.compile(r"[A-Za-z0-9._-]{1,64}")
_NONCE = re.compile(r"[0-9a-f]{16}")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveIdentity:
    """Who a save is: the job's attempt and a nonce rank 0 drew for this one save.

    Every rank of the save carries it (in its staged slot), its parts are stored
    under it, and the manifest records it: a commit is exactly one save.
    """

    attempt: str
    nonce: str

    def __post_init__(self) -> None:
        if not _ATTEMPT.fullmatch(self.attempt) or not _NONCE.fullmatch(self.nonce):
            raise ValueError(f"bad save identity {self.attempt!r}/{self.nonce!r}")

    @classmethod
    def new(cls, attempt: str) -> SaveIdentity:
        return cls(attempt, secrets.token_hex(8))

    @property
    def key(self) -> str:
        """Its name in object keys (the nonce is fixed-length, so this parses back)."""
        return f"{self.attempt}-{self.nonce}"

    @classmethod
    def parse(cls, key: str) -> SaveIdentity:
        attempt, _, nonce = key.rpartition("-")
        return cls(attempt, nonce)

    def __str__(self) -> str:
        return f"attempt {self.attempt}, save {self.nonce}"

    def to_json(self) -> dict[str, str]:
        return {"attempt": self.attempt, "nonce": self.nonce}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SaveIdentity:
        return cls(str(raw["attempt"]), str(raw["nonce"]))

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


def step_parts_prefix(step: int) -> str:
    return f"{PARTS}{step:020d}/"


def part_prefix(step: int, save: SaveIdentity) -> str:
    return f"{step_parts_prefix(step)}{save.key}/"


def part_key(step: int, save: SaveIdentity, rank: int) -> str:
    return f"{part_prefix(step, save)}rank-{rank:05d}.json"


def failure_key(step: int, save: SaveIdentity, who: str) -> str:
    """Where a rank (``rank-<r>``) or the committer (``commit``) says the save failed."""
    return f"{part_prefix(step, save)}{who}.failed"


@dataclasses.dataclass(frozen=True, slots=True)
class PartKey:
    """A parsed key under parts/: its step and save (None for a version 1 part)."""

    step: int
    save: SaveIdentity | None
    name: str  # rank-<r>.json or <who>.failed

    @classmethod
    def parse(cls, key: str) -> PartKey | None:
        fields = key[len(PARTS) :].split("/") if key.startswith(PARTS) else []
        try:
            if len(fields) == 2:
                return cls(int(fields[0]), None, fields[1])
            if len(fields) == 3:
                return cls(int(fields[0]), SaveIdentity.parse(fields[1]), fields[2])
        except ValueError:
            return None
        return None

    @property
    def is_part(self) -> bool:
        return self.name.startswith("rank-") and self.name.endswith(".json")


def chunk_key(chunk_id: str, codec: str) -> str:
    """Where a chunk is stored under a codec; ValueError for a codec this ctj does not know
    (never a guessed key: gc must not mistake another object for it)."""
    return f"{CHUNKS}{chunk_id[:2]}/{chunk_id}{_SUFFIX[Codec(codec)]}"


def rank_file_name(rank: int, index: int = 0) -> str:
    """A rank's data files: 0 holds its tensors, 1 its non-tensor values (if any)."""
    return f"__{rank}_{index}.distcp"


@dataclasses.dataclass(frozen=True, slots=True)
class ChunkRef:
    id: str
    size: int  # raw bytes
    stored_size: int  # bytes in the store (compressed size for zstd)
    codec: str  # a Codec value
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
    save: SaveIdentity | None = None  # which save committed it (None: a version 1 manifest)

    def chunks(self) -> dict[str, ChunkRef]:
        """Every chunk it names, by stored object key (id and codec)."""
        return {c.key: c for f in self.files.values() for c in f.chunks}

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
            "save": self.save.to_json() if self.save else None,
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
            save=SaveIdentity.from_json(raw["save"]) if raw.get("save") else None,
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """What one rank uploaded for one save, written before the commit."""

    step: int
    rank: int
    save: SaveIdentity
    world_size: int  # of the save it belongs to
    files: dict[str, FileEntry]
    uploaded_bytes: int
    deduplicated_bytes: int
    upload_seconds: float

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "save": self.save.to_json(),
                "world_size": self.world_size,
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
            save=SaveIdentity.from_json(raw["save"]),
            world_size=int(raw["world_size"]),
            files={k: FileEntry.from_json(v) for k, v in raw["files"].items()},
            uploaded_bytes=int(raw["uploaded_bytes"]),
            deduplicated_bytes=int(raw["deduplicated_bytes"]),
            upload_seconds=float(raw["upload_seconds"]),
        )
