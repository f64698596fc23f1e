"""Peer replication's choice: the neighbour pod's ranks' chunks, each once (pure)."""

from __future__ import annotations

from trainer_sidecar.format.manifest import ChunkRef, FileEntry, Manifest
from trainer_sidecar.store.peers import own_index
from trainer_sidecar.store.replication import neighbour_chunks


def chunk(n: int) -> ChunkRef:
    return ChunkRef(f"{n:064x}", 4, 4, "none", ("00" * 32,))


def manifest(world_size: int, files: dict[str, list[int]]) -> Manifest:
    return Manifest(
        step=10,
        mode="full",
        parent_step=None,
        base_step=10,
        since_full=0,
        world_size=world_size,
        block_size=1 << 20,
        files={
            name: FileEntry(4 * len(ids), tuple(chunk(i) for i in ids))
            for name, ids in files.items()
        },
        logical_bytes=0,
        uploaded_bytes=0,
        deduplicated_bytes=0,
        created=0.0,
    )


FILES = {
    ".metadata": [9],
    "__0_0.distcp": [1, 2],
    "__0_1.distcp": [3],
    "__1_0.distcp": [4, 2],  # chunk 2 also in rank 0's file: copied once
    "__2_0.distcp": [5],
    "__3_0.distcp": [6],
}


def ids(refs: list[ChunkRef]) -> set[int]:
    return {int(c.id, 16) for c in refs}


def test_each_pod_copies_the_next_pods_ranks_and_the_last_wraps_around_to_the_coordinator() -> None:
    m = manifest(4, FILES)
    assert ids(neighbour_chunks(m, 0, 4)) == {4, 2}
    assert ids(neighbour_chunks(m, 2, 4)) == {6}
    assert ids(neighbour_chunks(m, 3, 4)) == {9, 1, 2, 3}  # rank 0's files and .metadata
    assert len(neighbour_chunks(m, 0, 4)) == 2


def test_several_ranks_per_pod_and_nothing_to_copy_without_a_neighbour() -> None:
    m = manifest(4, FILES)
    assert ids(neighbour_chunks(m, 0, 2)) == {5, 6}  # pod 1 holds ranks 2 and 3
    assert neighbour_chunks(m, 0, 1) == []  # one pod: nobody to copy from
    assert neighbour_chunks(m, 0, 3) == []  # 4 ranks over 3 pods: which are whose is unknown


def test_a_pod_finds_itself_in_the_peer_list_by_its_hostname() -> None:
    peers = ["job-a2-0.job:9402", "job-a2-1.job:9402", "job-a2-2.job:9402"]
    assert own_index(peers, "job-a2-1") == 1
    assert own_index(["demo-a1-master-0:9402", "demo-a1-worker-0:9402"], "demo-a1-worker-0") == 1
    assert own_index(peers, "elsewhere") is None
