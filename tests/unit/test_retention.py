"""Retention on a real (file://) store: the last ``keep_last`` commits by commit time stay,
whatever their steps; an unreadable manifest is ordered by the store's own time."""

from __future__ import annotations

import os
from pathlib import Path

from trainer_sidecar.format.manifest import Manifest, manifest_key
from trainer_sidecar.store import repository as repo
from trainer_sidecar.store.local import LocalStore


def commit(store: LocalStore, step: int, *, created: float, base: int | None = None) -> None:
    manifest = Manifest(
        step=step,
        mode="full" if base is None else "differential",
        parent_step=None,
        base_step=step if base is None else base,
        since_full=0 if base is None else 1,
        world_size=1,
        block_size=1 << 20,
        files={},
        logical_bytes=0,
        uploaded_bytes=0,
        deduplicated_bytes=0,
        created=created,
    )
    store.put(manifest_key(step), manifest.to_bytes(), if_absent=True)


def test_a_run_below_the_stored_steps_keeps_its_own_commits(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    for n, step in enumerate((500, 501, 502)):
        commit(store, step, created=1000.0 + n)
    commit(store, 10, created=2000.0)  # a new run, started at step 10, committed later
    assert repo.apply_retention(store, 3) == [500]
    assert repo.committed_steps(store) == [10, 501, 502]
    commit(store, 11, created=2001.0, base=10)
    commit(store, 12, created=2002.0, base=10)
    assert repo.apply_retention(store, 2) == [501, 502]
    assert repo.committed_steps(store) == [10, 11, 12]  # 10: the base of the kept deltas


def test_an_unreadable_manifest_is_ordered_by_its_stored_time(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    commit(store, 1, created=1000.0)
    store.put(manifest_key(2), b"{not json")
    os.utime(tmp_path / manifest_key(2), (500.0, 500.0))  # stored before step 1's commit
    commit(store, 3, created=3000.0)
    assert repo.apply_retention(store, 2) == [2]
