"""The checkpoint format: object keys, chunk references, the per-step manifest.

Format ``ctj-checkpoint`` version 3 (docs/format.md is the reference):

    chunks/<id[:2]>/<id>[.zst]            content-addressed chunk, stored once
    ranks/<h[:2]>/<h>.json                one rank's chunk lists (h = BLAKE3 of these bytes)
    parts/<step>/<save>/rank-<r>.json     one rank's share of a save, small (pre-commit)
    parts/<step>/<save>/<who>.failed      a rank's (or the commit's) failure, for the others
    manifests/<step>.json                 the commit: a checkpoint exists iff this does
    retired/<step>.json                   a removed checkpoint's manifest, kept for the gc grace

``<save>`` is the save's identity (attempt and a nonce rank 0 chose): a commit
takes exactly the parts of ranks 0..W-1 of one save, so nothing another attempt,
a straggler or a second writer left can enter it. A checkpoint names every
chunk of every file it has, so a restore never walks a delta chain, and
deleting any other checkpoint cannot break it.

Why version 3: the block digests of a large job are big (about 64 MB of JSON
per TB of state) and each rank needs only its share. So the manifest stays
small (per rank: its rank manifest's hash, its file names and sizes, its
totals) and each rank's chunk lists live in that rank's own immutable,
content-addressed rank manifest, fetched (and its hash checked) only by a
reader that touches one of its files (``RankFiles``). Versions 1 (parts
directly under ``parts/<step>/``, no identity) and 2 (every chunk list inline
in the manifest) are still read.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import blake3

from ..errors import CorruptManifestError, ObjectNotFound
from .chunking import block_size_problem, chunk_size_problem

FORMAT = "ctj-checkpoint"
FORMAT_VERSION = 3
INLINE_VERSION = 2  # the last version with every chunk list in the manifest itself
METADATA_FILE = ".metadata"

MIB = 1 << 20
# The most bytes a reader takes of each kind of object (docs/format.md, "Limits: what a
# reader trusts"): it reads at most one byte more (store.base.read_bounded) and refuses
# anything larger as it would a corrupt one, before parsing it. Each is far above what a
# writer makes: a version 3 manifest is ~200 bytes a rank (256 MiB: over a million
# ranks); a rank manifest, or a version 2 manifest or part with every chunk list inline,
# ~64 MiB per TiB of state at 1 MiB blocks (256 MiB: 4 TiB); DCP's .metadata a few
# hundred bytes per saved tensor shard.
MAX_MANIFEST_BYTES = 256 * MIB
MAX_RANK_MANIFEST_BYTES = 256 * MIB
MAX_PART_BYTES = 256 * MIB
MAX_METADATA_BYTES = 1024 * MIB


def _min_json(value: object) -> int:
    return len(json.dumps(value, separators=(",", ":")))


# The fewest bytes one entry can take in its object (the shortest JSON a parser accepts
# for it: no spaces, zero numbers, an empty name): an object of N bytes lists at most
# N // that many, whatever a count in it claims.
MIN_RANK_REF_BYTES = _min_json({"rank": 0, "manifest": "0" * 64, "files": {}})  # 99
MIN_FILE_ENTRY_BYTES = _min_json({"": {"size": 0, "chunks": []}}) - 2  # 25: '"":{...}'


def check_object_size(data: bytes | memoryview, limit: int, what: str) -> None:
    """ValueError when ``data`` (an object as read, at most ``limit + 1`` bytes) is larger
    than ``limit``, the most a ``what`` may be."""
    if len(data) > limit:
        raise ValueError(f"is larger than the {limit} bytes a {what} may be")


def _size(value: object, what: str) -> int:
    """A size or count from a record: a non-negative integer, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int | str) or int(value) < 0:
        raise ValueError(f"{what} {value!r} is not a non-negative integer")
    return int(value)


def _block_size(value: object) -> int:
    block_size = _size(value, "block size")
    problem = block_size_problem(block_size)
    if problem:
        raise ValueError(f"block size {block_size} {problem}")
    return block_size


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
RANKS = "ranks/"
RANK_FORMAT = "ctj-checkpoint-rank"


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
        """A chunk entry; ValueError when its sizes are outside the format's limits
        (checked before anything is allocated by them)."""
        cid, size, stored, codec, blocks = raw
        raw_size, stored_size = _size(size, "raw size"), _size(stored, "stored size")
        ref = cls(str(cid), raw_size, stored_size, str(codec), tuple(blocks))
        problem = chunk_size_problem(ref.size, ref.stored_size)
        if problem:
            raise ValueError(f"chunk {ref.id[:64]!r} {problem}")
        return ref


@dataclasses.dataclass(frozen=True, slots=True)
class FileEntry:
    """One DCP file of the checkpoint as an ordered list of chunks."""

    size: int
    chunks: tuple[ChunkRef, ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "chunks": [c.to_json() for c in self.chunks]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> FileEntry:
        return cls(
            _size(raw["size"], "file size"), tuple(ChunkRef.from_json(c) for c in raw["chunks"])
        )


def rank_manifest_key(digest: str) -> str:
    """Where a rank manifest lives: at the BLAKE3 of its own bytes (so it is immutable)."""
    return f"{RANKS}{digest[:2]}/{digest}.json"


def rank_digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True, slots=True)
class RankRef:
    """What a version 3 manifest says of one rank's share: where its chunk lists are, and
    what planning, listing and retention need without reading them (names, sizes, totals)."""

    rank: int
    digest: str  # BLAKE3 hex of the rank manifest's bytes: its key and its check
    files: dict[str, int]  # file name -> size
    uploaded_bytes: int = 0
    deduplicated_bytes: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0 or not _HEX64.fullmatch(self.digest):
            raise ValueError(f"bad rank manifest reference {self.rank}/{self.digest!r}")

    @property
    def key(self) -> str:
        return rank_manifest_key(self.digest)

    @property
    def logical_bytes(self) -> int:
        return sum(self.files.values())

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "manifest": self.digest,
            "files": dict(sorted(self.files.items())),
            "uploaded_bytes": self.uploaded_bytes,
            "deduplicated_bytes": self.deduplicated_bytes,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> RankRef:
        return cls(
            int(raw["rank"]),
            str(raw["manifest"]),
            {str(k): _size(v, "file size") for k, v in raw["files"].items()},
            int(raw.get("uploaded_bytes", 0)),
            int(raw.get("deduplicated_bytes", 0)),
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankManifest:
    """One rank's chunk lists of one save (version 3): ``ranks/<h[:2]>/<h>.json``."""

    step: int
    rank: int
    save: SaveIdentity
    block_size: int
    files: dict[str, FileEntry]

    def to_bytes(self) -> bytes:
        body = {
            "format": RANK_FORMAT,
            "version": FORMAT_VERSION,
            "step": self.step,
            "rank": self.rank,
            "save": self.save.to_json(),
            "block_size": self.block_size,
            "files": {name: f.to_json() for name, f in sorted(self.files.items())},
        }
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankManifest:
        check_object_size(data, MAX_RANK_MANIFEST_BYTES, "rank manifest")
        raw = json.loads(data)
        if raw.get("format") != RANK_FORMAT:
            raise ValueError("not a ctj rank manifest")
        if int(raw.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(f"rank manifest version {raw['version']} is newer than this ctj")
        return cls(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            save=SaveIdentity.from_json(raw["save"]),
            block_size=_block_size(raw["block_size"]),
            files={str(k): FileEntry.from_json(v) for k, v in raw["files"].items()},
        )


def open_rank_manifest(
    data: bytes, ref: RankRef, *, step: int, save: SaveIdentity | None, block_size: int | None
) -> dict[str, FileEntry]:
    """The chunk lists of the rank manifest ``ref`` names, from its bytes; ValueError (the
    reason) unless they hash to ``ref.digest``, parse, and are that rank's of that save,
    with exactly the files and sizes the manifest gives (``block_size`` None: any)."""
    check_object_size(data, MAX_RANK_MANIFEST_BYTES, "rank manifest")
    if rank_digest(data) != ref.digest:
        raise ValueError("fails its hash check")
    try:
        part = RankManifest.from_bytes(data)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"is unreadable ({exc})") from None
    if (part.step, part.rank, part.save) != (step, ref.rank, save) or part.block_size != (
        block_size or part.block_size
    ):
        raise ValueError(
            f"belongs to step {part.step}, rank {part.rank} ({part.save}), not to this checkpoint"
        )
    if {n: f.size for n, f in part.files.items()} != ref.files:
        raise ValueError("names other files or sizes than the checkpoint's manifest")
    return part.files


Fetch = Callable[[str], bytes]  # an object's bytes by key (ObjectNotFound if there is none)
EntryCheck = Callable[[str, FileEntry], None]  # raises if a file's chunk list is malformed


class RankFiles(Mapping[str, FileEntry]):
    """A version 3 manifest's files: names and sizes come with the manifest; a rank's chunk
    lists are fetched, hash-checked and parsed the first time one of its files is looked
    up, once. ``in``, ``len``, iteration and ``sizes()`` read nothing.

    A rank manifest that is missing, fails its hash, does not parse or does not match
    makes the checkpoint unusable (``CorruptManifestError``, skipped like a corrupt chunk).
    Bound to a store by ``fetch``; a pickled copy (another rank's) travels unbound and is
    bound again there (``Manifest.bound``).
    """

    def __init__(
        self,
        refs: tuple[RankRef, ...],
        *,
        step: int,
        save: SaveIdentity | None,
        block_size: int,
        fetch: Fetch | None = None,
        check: EntryCheck | None = None,
        loaded: dict[int, dict[str, FileEntry]] | None = None,
    ) -> None:
        self.refs = refs
        self.step, self.save, self.block_size = step, save, block_size
        self._fetch, self._check = fetch, check
        self._owner: dict[str, RankRef] = {}
        for ref in refs:
            for name in ref.files:
                if name in self._owner:
                    raise ValueError(f"file {name!r} is given to two ranks")
                self._owner[name] = ref
        self._loaded: dict[int, dict[str, FileEntry]] = dict(loaded or {})
        self._lock = threading.Lock()

    def bound(self, fetch: Fetch, check: EntryCheck | None = None) -> RankFiles:
        """The same files read through ``fetch`` (what this copy already loaded is kept
        only when no new check must see it)."""
        keep = self._loaded if check is None or check is self._check else None
        return RankFiles(
            self.refs,
            step=self.step,
            save=self.save,
            block_size=self.block_size,
            fetch=fetch,
            check=check,
            loaded=keep,
        )

    @property
    def has_store(self) -> bool:
        return self._fetch is not None

    def __reduce__(self) -> tuple[Any, ...]:
        # another rank gets the names and sizes, never this process's store or what it read
        return _unbound_rank_files, (self.refs, self.step, self.save, self.block_size)

    def __getitem__(self, name: str) -> FileEntry:
        return self.of_rank(self._owner[name].rank)[name]

    def __contains__(self, name: object) -> bool:
        return name in self._owner

    def __iter__(self) -> Iterator[str]:
        return iter(self._owner)

    def __len__(self) -> int:
        return len(self._owner)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RankFiles):
            return (self.refs, self.step, self.save) == (other.refs, other.step, other.save)
        return NotImplemented if not isinstance(other, Mapping) else dict(self) == dict(other)

    __hash__ = None  # type: ignore[assignment]

    def sizes(self) -> dict[str, int]:
        return {name: ref.files[name] for name, ref in self._owner.items()}

    def owner(self, name: str) -> RankRef:
        return self._owner[name]

    @property
    def loaded_ranks(self) -> frozenset[int]:
        return frozenset(self._loaded)

    def of_rank(self, rank: int) -> dict[str, FileEntry]:
        """One rank's chunk lists (fetched and checked on first use)."""
        with self._lock:
            got = self._loaded.get(rank)
            if got is None:
                got = self._load(self.refs[rank])
                self._loaded[rank] = got
        return got

    def _load(self, ref: RankRef) -> dict[str, FileEntry]:
        what = f"rank {ref.rank}'s manifest {ref.key}"
        if self._fetch is None:
            raise RuntimeError(f"{what}: this manifest is bound to no store (Manifest.bound)")
        try:
            data = self._fetch(ref.key)
        except ObjectNotFound:
            raise CorruptManifestError(self.step, what, "is missing") from None
        try:
            files = open_rank_manifest(
                data, ref, step=self.step, save=self.save, block_size=self.block_size
            )
        except ValueError as exc:
            raise CorruptManifestError(self.step, what, str(exc)) from None
        if self._check is not None:
            for name, entry in files.items():
                self._check(name, entry)
        return files


def _unbound_rank_files(
    refs: tuple[RankRef, ...], step: int, save: SaveIdentity | None, block_size: int
) -> RankFiles:
    return RankFiles(refs, step=step, save=save, block_size=block_size)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    step: int
    mode: str
    parent_step: int | None  # the previous committed checkpoint when this one was planned
    base_step: int  # the last full checkpoint this one's deltas are against (itself if full)
    since_full: int  # checkpoints since the last full one (0 for a full one)
    world_size: int
    block_size: int
    files: Mapping[str, FileEntry]  # a RankFiles (version 3), or every chunk list inline
    logical_bytes: int
    uploaded_bytes: int
    deduplicated_bytes: int
    created: float
    timings: dict[str, float] = dataclasses.field(default_factory=dict)
    versions: dict[str, str] = dataclasses.field(default_factory=dict)
    save: SaveIdentity | None = None  # which save committed it (None: a version 1 manifest)

    @property
    def version(self) -> int:
        """The layout it is written in: 3 (rank manifests), 2 (inline), 1 (no identity)."""
        if isinstance(self.files, RankFiles):
            return FORMAT_VERSION
        return INLINE_VERSION if self.save else 1

    @property
    def ranks(self) -> tuple[RankRef, ...]:
        """Its rank manifests (version 3; empty for an inline manifest)."""
        return self.files.refs if isinstance(self.files, RankFiles) else ()

    def rank_files(self, rank: int) -> dict[str, FileEntry]:
        """One rank's chunk lists: a version 3 manifest reads that rank's manifest alone (an
        inline one records no owner per file: every file)."""
        if isinstance(self.files, RankFiles):
            return self.files.of_rank(rank)
        return dict(self.files)

    def rank_keys(self) -> set[str]:
        return {r.key for r in self.ranks}

    def file_sizes(self) -> dict[str, int]:
        """Every file's size, without reading any rank manifest."""
        if isinstance(self.files, RankFiles):
            return self.files.sizes()
        return {name: f.size for name, f in self.files.items()}

    def bound(self, fetch: Fetch, check: EntryCheck | None = None) -> Manifest:
        """This manifest reading its rank manifests through ``fetch`` (a no-op inline)."""
        if not isinstance(self.files, RankFiles):
            return self
        return dataclasses.replace(self, files=self.files.bound(fetch, check))

    def chunks(self) -> dict[str, ChunkRef]:
        """Every chunk it names, by stored object key (id and codec). Reads every rank
        manifest of a version 3 manifest: for gc and verify, not for a load."""
        return {c.key: c for f in self.files.values() for c in f.chunks}

    def chunk_ids(self) -> set[str]:
        return {c.id for f in self.files.values() for c in f.chunks}

    def chunk_keys(self) -> set[str]:
        return {c.key for f in self.files.values() for c in f.chunks}

    def to_bytes(self) -> bytes:
        """Version 3 when its files are a RankFiles (what a commit writes); else the inline
        version 2 layout (every chunk list in the manifest)."""
        body: dict[str, Any] = {
            "format": FORMAT,
            "version": FORMAT_VERSION if isinstance(self.files, RankFiles) else INLINE_VERSION,
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
        }
        if isinstance(self.files, RankFiles):
            body["ranks"] = [r.to_json() for r in self.files.refs]
        else:
            body["files"] = {name: f.to_json() for name, f in sorted(self.files.items())}
        return json.dumps(body, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(
        cls, data: bytes, *, fetch: Fetch | None = None, check: EntryCheck | None = None
    ) -> Manifest:
        """Parse a manifest of any version. A version 3 one reads its rank manifests through
        ``fetch`` when they are needed (``check`` sees each chunk list it loads).

        ValueError for anything malformed, and for sizes and counts outside the format's
        limits: a manifest larger than MAX_MANIFEST_BYTES, a block size out of range, a
        world size larger than the manifest's own bytes can list."""
        check_object_size(data, MAX_MANIFEST_BYTES, "manifest")
        raw = json.loads(data)
        if raw.get("format") != FORMAT:
            raise ValueError("not a ctj checkpoint manifest")
        if int(raw.get("version", 0)) > FORMAT_VERSION:
            raise ValueError(
                f"manifest format version {raw['version']} is newer than this ctj "
                f"understands ({FORMAT_VERSION}): upgrade ctj"
            )
        step, block_size = int(raw["step"]), _block_size(raw["block_size"])
        world_size = _world_size(raw["world_size"], len(data), inline="ranks" not in raw)
        save = SaveIdentity.from_json(raw["save"]) if raw.get("save") else None
        files: Mapping[str, FileEntry]
        if "ranks" in raw:
            refs = tuple(RankRef.from_json(r) for r in raw["ranks"])
            if len(refs) != world_size or any(r.rank != i for i, r in enumerate(refs)):
                raise ValueError(f"its ranks are not exactly 0..{world_size - 1}")
            if save is None:
                raise ValueError("a version 3 manifest names no save")
            files = RankFiles(
                refs, step=step, save=save, block_size=block_size, fetch=fetch, check=check
            )
        else:
            files = {k: FileEntry.from_json(v) for k, v in raw["files"].items()}
        return cls(
            step=step,
            mode=str(raw["mode"]),
            parent_step=raw["parent_step"],
            base_step=int(raw["base_step"]),
            since_full=int(raw["since_full"]),
            world_size=world_size,
            block_size=block_size,
            files=files,
            logical_bytes=int(raw["logical_bytes"]),
            uploaded_bytes=int(raw["uploaded_bytes"]),
            deduplicated_bytes=int(raw["deduplicated_bytes"]),
            created=float(raw["created"]),
            timings={k: float(v) for k, v in raw.get("timings", {}).items()},
            versions={k: str(v) for k, v in raw.get("versions", {}).items()},
            save=save,
        )


def _world_size(value: object, nbytes: int, *, inline: bool) -> int:
    """A manifest's world size, bounded by what its ``nbytes`` can list: a version 3
    manifest names each rank (MIN_RANK_REF_BYTES at least), an inline one lists each
    rank's tensor file (MIN_FILE_ENTRY_BYTES at least); ValueError beyond that."""
    world_size = _size(value, "world size")
    most = nbytes // (MIN_FILE_ENTRY_BYTES if inline else MIN_RANK_REF_BYTES)
    if world_size > most:
        raise ValueError(
            f"claims {world_size} ranks, more than its {nbytes} bytes can list (at most {most})"
        )
    return world_size


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RankPart:
    """What one rank stored for one save, written before the commit: in version 3 a pointer
    to its rank manifest with its files' sizes and totals (the commit reads only these)."""

    step: int
    rank: int
    save: SaveIdentity
    world_size: int  # of the save it belongs to
    manifest: str  # the digest of its rank manifest ("" for a version 2 part)
    sizes: dict[str, int]  # file name -> size
    uploaded_bytes: int
    deduplicated_bytes: int
    upload_seconds: float
    inline: dict[str, FileEntry] | None = None  # a version 2 part's chunk lists

    @classmethod
    def of(
        cls,
        rank_manifest: RankManifest,
        data: bytes,
        *,
        world_size: int,
        uploaded_bytes: int,
        deduplicated_bytes: int,
        upload_seconds: float,
    ) -> RankPart:
        """The part naming ``rank_manifest`` (``data``: its bytes as stored)."""
        return cls(
            step=rank_manifest.step,
            rank=rank_manifest.rank,
            save=rank_manifest.save,
            world_size=world_size,
            manifest=rank_digest(data),
            sizes={n: f.size for n, f in rank_manifest.files.items()},
            uploaded_bytes=uploaded_bytes,
            deduplicated_bytes=deduplicated_bytes,
            upload_seconds=upload_seconds,
        )

    def share(self) -> RankRef:
        """What the manifest says of this rank (version 3 parts only)."""
        return RankRef(
            self.rank, self.manifest, dict(self.sizes), self.uploaded_bytes, self.deduplicated_bytes
        )

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "step": self.step,
                "rank": self.rank,
                "save": self.save.to_json(),
                "world_size": self.world_size,
                "manifest": self.manifest,
                "files": self.sizes,
                "uploaded_bytes": self.uploaded_bytes,
                "deduplicated_bytes": self.deduplicated_bytes,
                "upload_seconds": self.upload_seconds,
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> RankPart:
        check_object_size(data, MAX_PART_BYTES, "part")
        raw = json.loads(data)
        inline = None
        if "manifest" in raw:
            sizes = {str(k): _size(v, "file size") for k, v in raw["files"].items()}
        else:  # version 2: the chunk lists themselves
            inline = {str(k): FileEntry.from_json(v) for k, v in raw["files"].items()}
            sizes = {k: f.size for k, f in inline.items()}
        return cls(
            step=int(raw["step"]),
            rank=int(raw["rank"]),
            save=SaveIdentity.from_json(raw["save"]),
            world_size=int(raw["world_size"]),
            manifest=str(raw.get("manifest", "")),
            sizes=sizes,
            uploaded_bytes=int(raw["uploaded_bytes"]),
            deduplicated_bytes=int(raw["deduplicated_bytes"]),
            upload_seconds=float(raw["upload_seconds"]),
            inline=inline,
        )
