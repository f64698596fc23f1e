"""The fenced commit's rules, the persister's and gc's, over an in-memory store (milliseconds)."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainer_sidecar import checkpointer
from trainer_sidecar.checkpointer import PendingSave
from trainer_sidecar.config import CheckpointConfig
from trainer_sidecar.errors import CheckpointError, CommitConflict, ObjectExists, SaveFailed
from trainer_sidecar.format.chunking import Span
from trainer_sidecar.format.manifest import (
    ChunkRef,
    FileEntry,
    Manifest,
    Mode,
    PartKey,
    RankManifest,
    RankPart,
    SaveIdentity,
    failure_key,
    manifest_key,
    part_key,
    part_prefix,
    rank_manifest_key,
)
from trainer_sidecar.format.policy import SavePlan, plan_save
from trainer_sidecar.metrics import CheckpointMetrics
from trainer_sidecar.save import slots
from trainer_sidecar.save.persist import Persister
from trainer_sidecar.store import commit as commits
from trainer_sidecar.store import repository
from trainer_sidecar.store.base import ObjectInfo
from trainer_sidecar.store.memory import MemoryStore

A1 = SaveIdentity("1", "aaaaaaaaaaaaaaaa")
A2 = SaveIdentity("2", "bbbbbbbbbbbbbbbb")
STEP = 5


def plan(save: SaveIdentity, step: int = STEP) -> SavePlan:
    return plan_save(step, mode=Mode.FULL, full_every=1, latest=None, save=save)


RANK_BODIES: dict[str, bytes] = {}  # rank manifests part() made, by digest


def part(
    save: SaveIdentity, rank: int, world: int, *, chunk: str = "", step: int = STEP
) -> RankPart:
    """A version 3 part; its rank manifest is stored with it by store_parts."""
    cid = chunk or f"{save.attempt}{rank}".ljust(64, "0")
    entry = FileEntry(4, (ChunkRef(cid, 4, 4, "none", ("b",)),))
    rank_manifest = RankManifest(
        step=step, rank=rank, save=save, block_size=1 << 20, files={f"__{rank}_0.distcp": entry}
    )
    body = rank_manifest.to_bytes()
    made = RankPart.of(
        rank_manifest,
        body,
        world_size=world,
        uploaded_bytes=4,
        deduplicated_bytes=0,
        upload_seconds=0.1,
    )
    RANK_BODIES[made.manifest] = body
    return made


def chunk_key_of(p: RankPart) -> str:
    files = RankManifest.from_bytes(RANK_BODIES[p.manifest]).files
    return next(iter(files.values())).chunks[0].key


def store_parts(store: MemoryStore, *parts: RankPart) -> None:
    """As upload_rank stores them: the rank manifest, then the part naming it."""
    for p in parts:
        store.put(rank_manifest_key(p.manifest), RANK_BODIES[p.manifest])
        commits.store_part(store, p)


def do_commit(store: MemoryStore, save: SaveIdentity, world: int) -> Manifest:
    return commits.commit(
        store, plan(save), world_size=world, block_size=1 << 20, timings={}, versions={}
    )


# -- pure rules -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ranks", "world", "error"),
    [
        ([0, 1, 2], 3, None),
        ([2, 0, 1], 3, None),
        ([0, 2], 3, "ranks [1] did not upload"),
        ([0, 1, 2, 3], 3, "parts of unknown ranks [3]"),
        ([], 1, "ranks [0] did not upload"),
    ],
)
def test_select_parts_takes_exactly_ranks_0_to_w_minus_1(
    ranks: list[int], world: int, error: str | None
) -> None:
    parts = [part(A2, r, world) for r in ranks]
    if error:
        with pytest.raises(CheckpointError, match=error.replace("[", r"\[").replace("]", r"\]")):
            commits.select_parts(parts, plan(A2), world)
    else:
        assert [p.rank for p in commits.select_parts(parts, plan(A2), world)] == list(range(world))


def test_select_parts_ignores_other_saves_and_refuses_another_world_size() -> None:
    mixed = [part(A1, 0, 2), part(A1, 1, 2), part(A2, 0, 2)]
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not upload"):
        commits.select_parts(mixed, plan(A2), 2)
    with pytest.raises(CheckpointError, match="staged for 3 ranks, the save planned 2"):
        commits.select_parts([part(A2, 0, 2), part(A2, 1, 3)], plan(A2), 2)


def test_read_progress_counts_only_this_saves_parts_and_failures() -> None:
    keys = [
        part_key(STEP, A2, 0),
        part_key(STEP, A2, 2),
        part_key(STEP, A1, 1),  # another attempt's
        part_key(STEP + 1, A2, 1),  # another step's
        failure_key(STEP, A2, "rank-1"),
        failure_key(STEP, A1, "commit"),
        "parts/garbage",
    ]
    got = commits.read_progress(keys, STEP, A2)
    assert got == commits.Progress(frozenset({0, 2}), ("rank-1",))


def test_part_keys_parse_back_both_format_versions() -> None:
    assert PartKey.parse(part_key(7, A1, 3)) == PartKey(7, A1, "rank-00003.json")
    assert PartKey.parse("parts/00000000000000000007/rank-00003.json") == PartKey(
        7, None, "rank-00003.json"
    )
    assert PartKey.parse("parts/x/y/z/w") is None
    assert SaveIdentity.parse(A1.key) == A1
    with pytest.raises(ValueError):
        SaveIdentity("1", "not-hex")


# -- commit -----------------------------------------------------------------------


def test_commit_takes_only_its_own_saves_parts() -> None:
    store = MemoryStore()
    # the dead attempt 1 left parts of the same step (world 2); attempt 2 runs at world 3
    store_parts(store, part(A1, 0, 2), part(A1, 1, 2))
    store_parts(store, *(part(A2, r, 3) for r in range(3)))
    manifest = do_commit(store, A2, 3)
    assert manifest.save == A2 and manifest.world_size == 3
    assert {c.id[:2] for c in manifest.chunks().values()} == {"20", "21", "22"}
    assert Manifest.from_bytes(store.get(manifest_key(STEP))).save == A2
    assert store.keys(part_prefix(STEP, A2)) == []  # its own parts are cleaned up
    assert len(store.keys(part_prefix(STEP, A1))) == 2  # the others wait for gc


def test_commit_with_a_missing_rank_writes_nothing() -> None:
    store = MemoryStore()
    store_parts(store, part(A2, 0, 2), part(A1, 1, 2))  # rank 1 only from another attempt
    with pytest.raises(CheckpointError, match=r"ranks \[1\] did not upload"):
        do_commit(store, A2, 2)
    assert store.keys("manifests/") == []


class LandedThenExists(MemoryStore):
    """A create-only PUT whose first try landed but whose reply was lost: the retry
    finds the key taken (S3 answers 412)."""

    def put(self, key: str, data: bytes | memoryview, *, if_absent: bool = False) -> None:
        super().put(key, data, if_absent=if_absent)
        if if_absent:
            raise ObjectExists(key)


def test_a_retried_commit_recognises_its_own_manifest() -> None:
    store = LandedThenExists()
    store_parts(store, part(A2, 0, 1))
    manifest = do_commit(store, A2, 1)
    assert manifest.save == A2


def test_a_commit_that_lost_to_another_save_says_so() -> None:
    store = MemoryStore()
    store_parts(store, part(A1, 0, 1))
    do_commit(store, A1, 1)
    store_parts(store, part(A2, 0, 1))
    with pytest.raises(CommitConflict, match="already committed by another save .attempt 1"):
        do_commit(store, A2, 1)
    assert Manifest.from_bytes(store.get(manifest_key(STEP))).save == A1


def test_outcome_of_a_save() -> None:
    store = MemoryStore()
    assert commits.outcome(store, STEP, A2) is None
    commits.report_failure(store, STEP, A2, "rank-1", "disk on fire")
    failed = commits.outcome(store, STEP, A2)
    assert isinstance(failed, SaveFailed) and "rank-1: disk on fire" in str(failed)
    store_parts(store, part(A1, 0, 1))
    do_commit(store, A1, 1)
    assert isinstance(commits.outcome(store, STEP, A1), Manifest)
    assert isinstance(commits.outcome(store, STEP, A2), CommitConflict)


def test_an_unreadable_manifest_at_the_step_fails_the_save_instead_of_raising() -> None:
    """A sidecar restarting with rank 0's slot of a step whose manifest is garbage asks
    outcome() first: a raise there crash-looped it; the step is taken, the save failed."""
    store = MemoryStore()
    store.put(manifest_key(STEP), b'{"format": "ctj-checkpoint", "world_size": "a lot"')
    failed = commits.outcome(store, STEP, A1)
    assert isinstance(failed, SaveFailed) and "cannot commit" in str(failed), failed
    repository.retire(store, [STEP])
    assert commits.outcome(store, STEP, A1) is None  # a retired one is history: still open


def test_a_retired_manifest_answers_only_for_its_own_save() -> None:
    store = MemoryStore()
    store_parts(store, part(A1, 0, 1))
    do_commit(store, A1, 1)
    repository.retire(store, [STEP])
    assert isinstance(commits.outcome(store, STEP, A1), Manifest)  # retention took it at once
    assert commits.outcome(store, STEP, A2) is None  # history, not an answer: still in flight


# -- gc -----------------------------------------------------------------------------


def test_gc_removes_the_committed_saves_parts_at_once_and_others_after_the_grace() -> None:
    store = MemoryStore()
    straggler = part(A1, 1, 2, chunk="ff".ljust(64, "1"))
    store.put(chunk_key_of(straggler), b"data")
    store_parts(store, straggler)
    store_parts(store, part(A2, 0, 1))
    do_commit(store, A2, 1)
    store_parts(store, part(A2, 0, 1))  # as if the cleanup after the commit was cut
    store.now += 10
    report = repository.collect_garbage(store, grace_s=60)
    assert store.keys(part_prefix(STEP, A2)) == []
    assert store.keys(part_prefix(STEP, A1)) == [part_key(STEP, A1, 1)]  # maybe in flight
    assert chunk_key_of(straggler) in store.keys("chunks/")
    assert report.deleted_parts == 1
    store.now += 120
    repository.collect_garbage(store, grace_s=60)
    assert store.keys("parts/") == [] and store.keys("chunks/") == []


def test_gc_stops_at_a_codec_it_does_not_know_and_deletes_nothing() -> None:
    """A manifest (a newer ctj's) naming a codec this one cannot name a key for: gc must
    not delete that object for want of its name, nor anything else."""
    store = MemoryStore()
    store_parts(store, part(A2, 0, 1))
    manifest = do_commit(store, A2, 1)
    chunk = manifest.files["__0_0.distcp"].chunks[0]
    # written inline (version 2), so the codec is in the manifest itself
    unknown = {
        name: FileEntry(f.size, tuple(dataclasses.replace(c, codec="zstd-bp8") for c in f.chunks))
        for name, f in manifest.files.items()
    }
    store.put(manifest_key(STEP), dataclasses.replace(manifest, files=unknown).to_bytes())
    store.put(f"chunks/{chunk.id[:2]}/{chunk.id}.bp8.zst", b"data")
    store.put("chunks/00/orphan", b"data")
    store.now += 120
    with pytest.raises(CheckpointError, match="gc stopped, nothing deleted: step 5 names"):
        repository.collect_garbage(store, grace_s=60)
    assert len(store.keys("chunks/")) == 2


# -- the persister ----------------------------------------------------------------


def stage(root: Path, rank: int, world: int, plan_: SavePlan, *, staged_at: float) -> Path:
    slot = slots.slot_dirs(root, rank, 1)[0]
    slot.mkdir(parents=True, exist_ok=True)  # a freed slot stays, empty of a staged save
    name = f"__{rank}_0.distcp"
    (slot / name).write_bytes(bytes([rank]) * 1000 + plan_.save.nonce.encode())
    files: tuple[tuple[str, tuple[Span, ...]], ...] = ((name, (Span(0, 1016),)),)
    slots.mark_ready(
        slot,
        slots.StagedCheckpoint(
            step=plan_.step,
            rank=rank,
            world_size=world,
            plan=plan_,
            files=files,
            staged_at=staged_at,
            stage_seconds=0.01,
        ),
    )
    return slot


def persister(store: MemoryStore, root: Path, *, rank: int | None, timeout: float = 5) -> Persister:
    config = CheckpointConfig(uri=f"file://{root}/store", commit_timeout_s=timeout, keep_last=0)
    return Persister(store, config, root=root, metrics=CheckpointMetrics(), rank=rank)


def wait_for_a_part(store: MemoryStore) -> None:
    """Until a rank's part of step STEP's save A2 is stored (5 s at most)."""
    deadline = time.monotonic() + 5
    while not store.keys(part_prefix(STEP, A2)):
        assert time.monotonic() < deadline, "no part was stored"
        time.sleep(0.005)


def test_a_sidecar_serving_every_rank_commits_and_frees_the_slots(tmp_path: Path) -> None:
    store = MemoryStore()
    p = persister(store, tmp_path, rank=None)
    futures = [p.watch(STEP, A2, rank) for rank in range(2)]
    for rank in range(2):
        stage(tmp_path, rank, 2, plan(A2), staged_at=time.time())
    assert p.run_once()
    assert slots.pending(tmp_path) == []
    manifest = futures[0].result(timeout=0)
    assert isinstance(manifest, Manifest) and manifest.save == A2
    assert futures[1].result(timeout=0) is None  # rank 1's part: stored, rank 0 commits
    assert set(manifest.files) == {"__0_0.distcp", "__1_0.distcp"}


class RequestCountingStore(MemoryStore):
    """A memory store counting its gets and lists (the requests an S3 store would send),
    and the prefixes it listed."""

    def __init__(self) -> None:
        super().__init__()
        self.requests = 0
        self.listed: list[str] = []

    def get(self, key: str, *, byte_range: tuple[int, int] | None = None) -> bytes:
        self.requests += 1
        return super().get(key, byte_range=byte_range)

    def list(self, prefix: str) -> Iterator[ObjectInfo]:
        self.requests += 1
        self.listed.append(prefix)
        return super().list(prefix)


@pytest.mark.parametrize(("grace_s", "gc_runs"), [(3600.0, 1), (0.0, 5)])
def test_a_frequent_saver_runs_gc_once_per_tenth_of_the_grace_not_every_commit(
    tmp_path: Path, grace_s: float, gc_runs: int
) -> None:
    """Six commits in a row, keep_last 1: each after the first retires one. With the
    default hour's grace gc runs at the first of those (then not again within 5 minutes,
    policy.gc_due); with no grace, after every one of them."""
    store = RequestCountingStore()
    config = CheckpointConfig(
        uri=f"file://{tmp_path}/store", keep_last=1, gc_grace_s=grace_s, commit_timeout_s=5
    )
    p = Persister(store, config, root=tmp_path, metrics=CheckpointMetrics(), rank=None)
    for step in range(1, 7):
        save = SaveIdentity("1", f"{step:016x}")
        stage(tmp_path, 0, 1, plan(save, step), staged_at=time.time())
        assert p.run_once()
    assert repository.committed_steps(store) == [6]
    assert store.listed.count("chunks/") == gc_runs  # each gc run lists every chunk


def test_a_sidecar_uploads_a_rank_staged_while_rank0_s_commit_waits_for_it(
    tmp_path: Path,
) -> None:
    """Two ranks of one pod, one sidecar: rank 0 staged first, rank 1 only once the sidecar
    was already waiting to commit rank 0's save. The part it waits for is its own to
    upload; it must not wait out the commit timeout (found by bench_async --placed: two
    ranks on one core, step 151 failed after 600 s)."""
    store = MemoryStore()
    p = persister(store, tmp_path, rank=None, timeout=60)
    fut = p.watch(STEP, A2, 0)
    stage(tmp_path, 0, 2, plan(A2), staged_at=time.time())
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(p.run_once)
        wait_for_a_part(store)  # rank 0's: the commit is waiting for rank 1's
        stage(tmp_path, 1, 2, plan(A2), staged_at=time.time())
        assert running.result(timeout=10) is True
    manifest = fut.result(timeout=0)
    assert isinstance(manifest, Manifest)
    assert set(manifest.files) == {"__0_0.distcp", "__1_0.distcp"}
    assert slots.pending(tmp_path) == []


def test_rank0_keeps_its_slot_until_the_commit_is_decided(tmp_path: Path) -> None:
    store = MemoryStore()
    p = persister(store, tmp_path, rank=0, timeout=0.3)
    fut = p.watch(STEP, A2, 0)
    stage(tmp_path, 0, 2, plan(A2), staged_at=time.time())
    with cf.ThreadPoolExecutor(1) as pool:
        running = pool.submit(p.run_once)
        wait_for_a_part(store)  # rank 0's
        assert [s.step for _, s in slots.pending(tmp_path)] == [STEP]  # uploaded, not freed
        running.result(timeout=10)
    with pytest.raises(SaveFailed, match="only 1 of 2 ranks uploaded"):
        fut.result(timeout=0)
    assert slots.pending(tmp_path) == []
    assert store.keys(failure_key(STEP, A2, "commit"))  # the other ranks learn it


def test_the_commit_stops_waiting_as_soon_as_a_rank_reports_failure(tmp_path: Path) -> None:
    store = MemoryStore()
    commits.report_failure(store, STEP, A2, "rank-1", "upload of chunk x: SlowDown")
    p = persister(store, tmp_path, rank=0, timeout=60)
    fut = p.watch(STEP, A2, 0)
    stage(tmp_path, 0, 2, plan(A2), staged_at=time.time())
    started = time.monotonic()
    p.run_once()
    assert time.monotonic() - started < 5
    with pytest.raises(SaveFailed, match="rank-1: upload of chunk x: SlowDown"):
        fut.result(timeout=0)


def test_a_restarted_sidecar_commits_what_was_fully_uploaded_without_uploading(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    store_parts(store, part(A2, 0, 2), part(A2, 1, 2))  # every part stored before the kill
    stage(tmp_path, 0, 2, plan(A2), staged_at=time.time() - 60)  # staged before the restart
    puts_before = len(store.puts)
    p = persister(store, tmp_path, rank=0)
    p.run_once()
    assert Manifest.from_bytes(store.get(manifest_key(STEP))).save == A2
    assert [k for k in store.puts[puts_before:] if k.startswith("chunks/")] == []
    assert slots.pending(tmp_path) == []


def test_a_restarted_sidecar_whose_commit_had_landed_only_frees_the_slot(tmp_path: Path) -> None:
    store = MemoryStore()
    store_parts(store, part(A2, 0, 1))
    do_commit(store, A2, 1)
    stage(tmp_path, 0, 1, plan(A2), staged_at=time.time() - 60)
    puts_before = len(store.puts)
    persister(store, tmp_path, rank=0).run_once()
    assert store.puts[puts_before:] == [] and slots.pending(tmp_path) == []


def test_failure_markers_carry_the_reason_as_json() -> None:
    store = MemoryStore()
    commits.report_failure(store, STEP, A1, "rank-3", "boom")
    assert json.loads(store.get(failure_key(STEP, A1, "rank-3"))) == {"reason": "boom"}


# -- what a training loop asks -----------------------------------------------------


def test_a_loop_asking_done_at_every_step_asks_the_store_at_most_every_poll_period(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PendingSave.done() where another process commits (a sidecar; rank 0 for the other
    ranks): the answer is the store's, asked at most every DONE_POLL_S, however often the
    loop asks; the commit is seen at the first poll after it."""
    store = RequestCountingStore()
    staged = slots.StagedCheckpoint(
        step=STEP, rank=1, world_size=2, plan=plan(A2), files=(), staged_at=time.time(),
        stage_seconds=0.01,
    )  # fmt: skip
    pending = PendingSave(
        store, staged, started=time.monotonic(), replanned=False, completion=None,
        default_timeout_s=5,
    )  # fmt: skip
    clock = [100.0]
    monkeypatch.setattr(checkpointer.time, "monotonic", lambda: clock[0])
    assert not pending.done()
    one_poll = store.requests  # the manifest, a retired one, the parts
    assert one_poll > 0
    assert not any(pending.done() for _ in range(1000))  # a loop's next thousand steps
    assert store.requests == one_poll
    store_parts(store, part(A2, 0, 2), part(A2, 1, 2))
    do_commit(store, A2, 2)
    assert not pending.done(), "not asked again within the period"
    clock[0] += checkpointer.DONE_POLL_S
    assert pending.done()
