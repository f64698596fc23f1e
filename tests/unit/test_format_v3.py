"""Format version 3: a small manifest naming per-rank rank manifests, read only where
needed; the commit's rules on it; gc keeping and sweeping rank manifests; versions 1 and
2 still read. Over an in-memory store (milliseconds)."""

from __future__ import annotations

import builtins
import json
import pickle
from pathlib import Path

import pytest

from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.errors import (
    CheckpointError,
    CommitConflict,
    CorruptCheckpointError,
    CorruptManifestError,
    ObjectExists,
)
from trainer_sidecar.format.chunking import Span
from trainer_sidecar.format.manifest import (
    FORMAT_VERSION,
    ChunkRef,
    FileEntry,
    Manifest,
    Mode,
    RankFiles,
    RankManifest,
    RankPart,
    SaveIdentity,
    manifest_key,
    part_key,
    rank_manifest_key,
)
from trainer_sidecar.format.policy import SavePlan, plan_save, reference_ranks
from trainer_sidecar.metrics import CheckpointMetrics
from trainer_sidecar.save import slots
from trainer_sidecar.save.persist import Persister
from trainer_sidecar.store import commit as commits
from trainer_sidecar.store import repository
from trainer_sidecar.store.memory import MemoryStore

A1 = SaveIdentity("1", "aaaaaaaaaaaaaaaa")
A2 = SaveIdentity("2", "bbbbbbbbbbbbbbbb")
A3 = SaveIdentity("3", "cccccccccccccccc")
BS = 1 << 20


class CountingStore(MemoryStore):
    """The memory store, noting the key of every get."""

    def __init__(self) -> None:
        super().__init__()
        self.gets: builtins.list[str] = []

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        self.gets.append(key)
        return super().get(key, byte_range=byte_range)


def cid(*seed: object) -> str:
    return "".join(f"{s}" for s in seed).encode().hex().ljust(64, "0")[:64]


def entry(*seed: object, size: int = 4) -> FileEntry:
    return FileEntry(size, (ChunkRef(cid(*seed), size, size, "none", (cid("b", *seed),)),))


def upload(
    store: MemoryStore,
    save: SaveIdentity,
    step: int,
    rank: int,
    world: int,
    files: dict[str, FileEntry] | None = None,
) -> RankPart:
    """What upload_rank stores for a rank: chunks, its rank manifest, then its part."""
    files = files or {f"__{rank}_0.distcp": entry(step, save.attempt, rank)}
    if rank == 0 and ".metadata" not in files:
        files[".metadata"] = entry(step, save.attempt, "md")
    for f in files.values():
        for c in f.chunks:
            store.put(c.key, b"x" * c.size)
    rank_manifest = RankManifest(step=step, rank=rank, save=save, block_size=BS, files=files)
    body = rank_manifest.to_bytes()
    part = RankPart.of(
        rank_manifest,
        body,
        world_size=world,
        uploaded_bytes=4,
        deduplicated_bytes=0,
        upload_seconds=0.1,
    )
    store.put(rank_manifest_key(part.manifest), body)
    commits.store_part(store, part)
    return part


def plan(save: SaveIdentity, step: int) -> SavePlan:
    return plan_save(step, mode=Mode.FULL, full_every=1, latest=None, save=save)


def commit(store: MemoryStore, save: SaveIdentity, step: int, world: int) -> Manifest:
    for rank in range(world):
        upload(store, save, step, rank, world)
    return commits.commit(
        store, plan(save, step), world_size=world, block_size=BS, timings={}, versions={}
    )


# -- the manifest -------------------------------------------------------------------


def test_a_commit_writes_version_3_a_manifest_without_chunk_lists() -> None:
    store = MemoryStore()
    manifest = commit(store, A1, 5, 4)
    raw = json.loads(store.get(manifest_key(5)))
    assert raw["version"] == FORMAT_VERSION == 3 and "files" not in raw
    assert [r["rank"] for r in raw["ranks"]] == [0, 1, 2, 3]
    assert raw["ranks"][1]["files"] == {"__1_0.distcp": 4}
    assert cid(5, "1", 1) not in store.get(manifest_key(5)).decode()  # no chunk id in it
    assert manifest.version == 3 and manifest.logical_bytes == 5 * 4
    assert set(manifest.file_sizes()) == {".metadata", *(f"__{r}_0.distcp" for r in range(4))}
    for ref in manifest.ranks:  # each rank manifest lives at the hash of its bytes
        assert ref.key == f"ranks/{ref.digest[:2]}/{ref.digest}.json"
        assert store.get(ref.key)


def test_names_and_sizes_read_nothing_and_a_file_reads_only_its_ranks_manifest() -> None:
    store = CountingStore()
    commit(store, A1, 5, 8)
    store.gets.clear()
    manifest = repository.read_manifest(store, 5)
    assert store.gets == [manifest_key(5)]
    assert "__3_0.distcp" in manifest.files and len(manifest.files) == 9
    assert manifest.file_sizes()["__3_0.distcp"] == 4
    assert store.gets == [manifest_key(5)]
    assert manifest.files["__3_0.distcp"].chunks[0].id == cid(5, "1", 3)
    manifest.files["__3_0.distcp"]  # noqa: B018 - loaded once
    assert store.gets[1:] == [manifest.ranks[3].key]
    assert manifest.files.loaded_ranks == {3}  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("flip", "fails its hash check"),
        ("delete", "is missing"),
        ("other-rank", "fails its hash check"),
    ],
)
def test_a_bad_rank_manifest_makes_the_checkpoint_corrupt(damage: str, why: str) -> None:
    store = MemoryStore()
    commit(store, A1, 5, 2)
    manifest = repository.read_manifest(store, 5)
    key = manifest.ranks[1].key
    if damage == "flip":
        body = bytearray(store.get(key))
        body[len(body) // 2] ^= 1
        store.put(key, bytes(body))
    elif damage == "delete":
        store.delete([key])
    else:  # rank 0's (valid) manifest stored where rank 1's should be
        store.put(key, store.get(manifest.ranks[0].key))
    assert manifest.files["__0_0.distcp"]  # rank 0's share is sound
    with pytest.raises(
        CorruptManifestError, match=f"step 5 is unusable: rank 1's manifest .* {why}"
    ):
        manifest.files["__1_0.distcp"]  # noqa: B018
    assert issubclass(CorruptManifestError, CorruptCheckpointError)  # restore skips it


def test_a_hash_valid_rank_manifest_of_another_save_or_files_is_refused() -> None:
    """A bucket writer can store any bytes at their own hash: what they say is checked."""
    store = MemoryStore()
    manifest = commit(store, A1, 5, 2)
    stray = RankManifest(
        step=5, rank=1, save=A2, block_size=BS, files={"__1_0.distcp": entry("x")}
    ).to_bytes()
    other = RankManifest(
        step=5, rank=1, save=A1, block_size=BS, files={"__1_0.distcp": entry("x", size=7)}
    ).to_bytes()
    for body, why in ((stray, "belongs to step 5, rank 1 .attempt 2"), (other, "other files")):
        ref = manifest.ranks[1]
        forged = RankFiles(
            (manifest.ranks[0], type(ref)(1, _digest(body), ref.files)),
            step=5,
            save=A1,
            block_size=BS,
            fetch=lambda key, body=body: body,
        )
        with pytest.raises(CorruptManifestError, match=why):
            forged["__1_0.distcp"]  # noqa: B018


def _digest(body: bytes) -> str:
    from trainer_sidecar.format.manifest import rank_digest

    return rank_digest(body)


def test_a_top_manifest_must_name_exactly_ranks_0_to_w_minus_1_once_each() -> None:
    store = MemoryStore()
    commit(store, A1, 5, 3)
    raw = json.loads(store.get(manifest_key(5)))
    missing = dict(raw, ranks=raw["ranks"][:2])
    with pytest.raises(ValueError, match="not exactly 0..2"):
        Manifest.from_bytes(json.dumps(missing).encode())
    twice = json.loads(json.dumps(raw))
    twice["ranks"][2]["files"] = {"__1_0.distcp": 4}
    with pytest.raises(ValueError, match="given to two ranks"):
        Manifest.from_bytes(json.dumps(twice).encode())
    with pytest.raises(CheckpointError, match="manifest of step 5 is unreadable"):
        store.put(manifest_key(5), json.dumps(missing).encode())
        repository.read_manifest(store, 5)


def test_a_manifest_sent_to_another_rank_carries_no_store_and_is_bound_there() -> None:
    store = CountingStore()
    commit(store, A1, 5, 2)
    manifest = repository.read_manifest(store, 5)
    manifest.files[".metadata"]  # noqa: B018 - rank 0 read its own share
    travelled = pickle.loads(pickle.dumps(manifest))
    assert travelled == manifest and travelled.files.loaded_ranks == frozenset()  # type: ignore[attr-defined]
    with pytest.raises(RuntimeError, match="bound to no store"):
        travelled.files["__1_0.distcp"]  # noqa: B018
    assert travelled.bound(store.get).files["__1_0.distcp"].size == 4


def test_versions_1_and_2_still_read() -> None:
    chunk = entry("v2").to_json()
    common = {
        "format": "ctj-checkpoint",
        "step": 3,
        "mode": "full",
        "parent_step": None,
        "base_step": 3,
        "since_full": 0,
        "world_size": 1,
        "block_size": BS,
        "logical_bytes": 4,
        "uploaded_bytes": 4,
        "deduplicated_bytes": 0,
        "created": 1.0,
        "files": {"__0_0.distcp": chunk},
    }
    v2 = Manifest.from_bytes(json.dumps({**common, "version": 2, "save": A1.to_json()}).encode())
    v1 = Manifest.from_bytes(json.dumps({**common, "version": 1}).encode())
    assert (v1.version, v2.version) == (1, 2) and v1.save is None and v2.save == A1
    for m in (v1, v2):
        assert m.ranks == () and m.file_sizes() == {"__0_0.distcp": 4}
        assert m.chunk_ids() == {cid("v2")}
        assert Manifest.from_bytes(m.to_bytes()).files == m.files  # rewritten inline


def test_a_version_2_part_left_by_an_older_ctj_commits_as_version_3() -> None:
    store = MemoryStore()
    upload(store, A1, 5, 0, 2)
    legacy = {
        "step": 5,
        "rank": 1,
        "save": A1.to_json(),
        "world_size": 2,
        "files": {"__1_0.distcp": entry("legacy").to_json()},
        "uploaded_bytes": 4,
        "deduplicated_bytes": 0,
        "upload_seconds": 0.1,
    }
    store.put(part_key(5, A1, 1), json.dumps(legacy).encode())
    manifest = commits.commit(
        store, plan(A1, 5), world_size=2, block_size=BS, timings={}, versions={}
    )
    assert manifest.version == 3
    assert repository.read_manifest(store, 5).files["__1_0.distcp"].chunks[0].id == cid("legacy")


# -- the commit's rules on version 3 ---------------------------------------------------


def test_the_commit_reads_the_parts_never_the_rank_manifests() -> None:
    store = CountingStore()
    for rank in range(16):
        upload(store, A1, 5, rank, 16)
    store.gets.clear()
    commits.commit(store, plan(A1, 5), world_size=16, block_size=BS, timings={}, versions={})
    assert all(k.startswith("parts/") or k == manifest_key(5) for k in store.gets), store.gets
    assert len([k for k in store.gets if k.startswith("parts/")]) == 16


def test_a_v3_commit_takes_only_its_saves_parts_and_fences_as_before() -> None:
    store = MemoryStore()
    for rank in range(2):  # a dead attempt's parts of the same step, at another world size
        upload(store, A1, 5, rank, 2)
    manifest = commit(store, A2, 5, 3)
    assert manifest.save == A2 and [r.rank for r in manifest.ranks] == [0, 1, 2]
    assert {f.chunks[0].id for n, f in manifest.files.items() if n != ".metadata"} == {
        cid(5, "2", r) for r in range(3)
    }
    upload(store, A3, 5, 0, 1)  # a second writer at the same URI, same step
    with pytest.raises(CommitConflict, match="already committed by another save .attempt 2"):
        commits.commit(store, plan(A3, 5), world_size=1, block_size=BS, timings={}, versions={})
    upload(store, A2, 6, 0, 2)
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not upload"):
        commits.commit(store, plan(A2, 6), world_size=2, block_size=BS, timings={}, versions={})
    assert store.keys("manifests/") == [manifest_key(5)]


class LandedThenExists(MemoryStore):
    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        if if_absent:
            raise ObjectExists(key)


def test_a_retried_v3_commit_recognises_its_own_manifest() -> None:
    assert commit(LandedThenExists(), A1, 5, 2).save == A1


# -- gc ---------------------------------------------------------------------------


def test_gc_keeps_what_live_and_retired_manifests_name_and_sweeps_leftovers() -> None:
    store = MemoryStore()
    kept = commit(store, A1, 1, 2)
    retired = commit(store, A1, 2, 2)
    upload(store, A2, 3, 0, 2)  # a save that never commits: rank 1 never uploads
    leftover = set(store.keys("ranks/")) - kept.rank_keys() - retired.rank_keys()
    assert len(leftover) == 1
    store.now += 10
    repository.collect_garbage(store, grace_s=60)  # in the grace: everything stays
    assert leftover <= set(store.keys("ranks/"))
    store.now += 120
    repository.retire(store, [2])  # retired now: young on the store's clock
    report = repository.collect_garbage(store, grace_s=60)
    assert set(store.keys("ranks/")) == kept.rank_keys() | retired.rank_keys()
    assert report.deleted_rank_manifests == 1
    assert store.keys("parts/") == []
    assert set(store.keys("chunks/")) == kept.chunk_keys() | retired.chunk_keys()
    store.now += 3600
    repository.collect_garbage(store, grace_s=60)
    assert store.keys("retired/") == []
    assert set(store.keys("ranks/")) == kept.rank_keys()  # the retired one's are gone
    assert set(store.keys("chunks/")) == kept.chunk_keys()


def test_gc_keeps_what_an_in_flight_parts_rank_manifest_names() -> None:
    store = MemoryStore()
    part = upload(store, A2, 3, 1, 2)
    store.now += 10
    commits.store_part(store, part)  # the part is young, its chunks and rank manifest are not
    repository.collect_garbage(store, grace_s=5)
    assert store.keys("ranks/") == [rank_manifest_key(part.manifest)]
    assert store.keys("chunks/") == [entry(3, "2", 1).chunks[0].key]
    store.now += 10
    repository.collect_garbage(store, grace_s=5)
    assert store.keys("ranks/") == store.keys("chunks/") == store.keys("parts/") == []


def test_gc_stops_before_deleting_anything_when_a_live_rank_manifest_is_unreadable() -> None:
    store = MemoryStore()
    manifest = commit(store, A1, 1, 2)
    store.put("chunks/ff/" + "f" * 64, b"orphan")
    store.delete([manifest.ranks[1].key])
    store.now += 3600
    before = store.keys()
    with pytest.raises(CheckpointError, match="gc stopped, nothing deleted: .* rm 1"):
        repository.collect_garbage(store, grace_s=60)
    assert [k for k in before if k != "clock"] == [k for k in store.keys() if k != "clock"]


# -- the dedup reference of a saving rank --------------------------------------------------


@pytest.mark.parametrize(
    ("rank", "world", "old", "want"),
    [
        (3, 8, 8, [3]),
        (0, 512, 1024, [0, 1]),
        (511, 512, 1024, [1022, 1023]),
        (0, 2048, 1024, [0]),
        (2047, 2048, 1024, [1023]),
        (1, 2, 3, [1, 2]),
        (0, 1, 4, [0, 1, 2, 3]),
        (4, 5, 2, [1]),
    ],
)
def test_reference_ranks_are_its_own_or_those_at_its_position(
    rank: int, world: int, old: int, want: list[int]
) -> None:
    assert list(reference_ranks(rank, world, old)) == want


def test_a_saving_rank_reads_only_its_own_rank_manifest_of_the_reference(
    tmp_path: Path,
) -> None:
    store = CountingStore()
    reference = commit(store, A1, 1, 4)
    delta = plan_save(
        2,
        mode=Mode.INCREMENTAL,
        full_every=10,
        latest=repository.policy.Committed.of(reference),
        save=A2,
    )
    slot = slots.slot_dirs(tmp_path, 2, 1)[0]
    slot.mkdir(parents=True)
    (slot / "__2_0.distcp").write_bytes(b"y" * 100)
    staged = slots.StagedCheckpoint(
        step=2,
        rank=2,
        world_size=4,
        plan=delta,
        files=(("__2_0.distcp", (Span(0, 100),)),),
        staged_at=0.0,
        stage_seconds=0.0,
    )
    config = CheckpointConfig(uri=f"file://{tmp_path}/store", keep_last=0)
    p = Persister(store, config, root=tmp_path, metrics=CheckpointMetrics(), rank=2)
    store.gets.clear()
    chunks = p._reference_chunks(staged)
    assert set(chunks) == {cid(1, "1", 2)}
    assert store.gets == [manifest_key(1), reference.ranks[2].key]


def test_a_version_2_checkpoint_serves_whole_as_a_reference_and_stays_through_gc(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    files = {f"__{r}_0.distcp": entry("old", r) for r in range(2)}
    for f in files.values():
        store.put(f.chunks[0].key, b"x" * 4)
    v2 = Manifest(
        step=1,
        mode="full",
        parent_step=None,
        base_step=1,
        since_full=0,
        world_size=2,
        block_size=BS,
        files=files,
        logical_bytes=8,
        uploaded_bytes=8,
        deduplicated_bytes=0,
        created=1.0,
        save=A1,
    )
    store.put(manifest_key(1), v2.to_bytes())
    assert json.loads(store.get(manifest_key(1)))["version"] == 2
    delta = plan_save(
        2, mode=Mode.INCREMENTAL, full_every=10, latest=repository.policy.Committed.of(v2), save=A2
    )
    staged = slots.StagedCheckpoint(
        step=2,
        rank=1,
        world_size=2,
        plan=delta,
        files=(("__1_0.distcp", (Span(0, 4),)),),
        staged_at=0.0,
        stage_seconds=0.0,
    )
    config = CheckpointConfig(uri=f"file://{tmp_path}/store", keep_last=0)
    p = Persister(store, config, root=tmp_path, metrics=CheckpointMetrics(), rank=1)
    assert set(p._reference_chunks(staged)) == {cid("old", 0), cid("old", 1)}  # all of it
    store.now += 3600
    repository.collect_garbage(store, grace_s=60)
    assert set(store.keys("chunks/")) == v2.chunk_keys()
