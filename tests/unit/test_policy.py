from __future__ import annotations

import pytest

from trainer_sidecar.format.manifest import SaveIdentity
from trainer_sidecar.format.policy import (
    GC_INTERVAL_CAP_S,
    Committed,
    gc_due,
    plan_gc,
    plan_retention,
    plan_save,
)
from trainer_sidecar.store.base import ObjectInfo

SAVE = SaveIdentity("0", "0123456789abcdef")


def manifest(step: int, *, mode: str, base: int, since_full: int) -> Committed:
    """The summary of a committed manifest (mode is what it was saved as)."""
    assert mode in ("full", "incremental", "differential")
    return Committed(step, base, since_full)


@pytest.mark.parametrize(
    ("mode", "full_every", "latest", "want"),
    [
        ("incremental", 5, None, ("full", None, 10, 0, None)),
        ("full", 5, manifest(9, mode="full", base=9, since_full=0), ("full", 9, 10, 0, None)),
        (
            "incremental",
            5,
            manifest(9, mode="full", base=9, since_full=0),
            ("incremental", 9, 9, 1, 9),
        ),
        (
            "incremental",
            5,
            manifest(9, mode="incremental", base=5, since_full=3),
            ("incremental", 9, 5, 4, 9),
        ),
        (
            "incremental",
            5,
            manifest(9, mode="incremental", base=5, since_full=4),
            ("full", 9, 10, 0, None),
        ),
        (
            "differential",
            5,
            manifest(9, mode="differential", base=5, since_full=2),
            ("differential", 9, 5, 3, 5),
        ),
        (
            "differential",
            1,
            manifest(9, mode="full", base=9, since_full=0),
            ("full", 9, 10, 0, None),
        ),
    ],
)
def test_plan_save(mode: str, full_every: int, latest: Committed | None, want: tuple) -> None:
    plan = plan_save(10, mode=mode, full_every=full_every, latest=latest, save=SAVE)
    assert (
        plan.mode,
        plan.parent_step,
        plan.base_step,
        plan.since_full,
        plan.reference_step,
    ) == want


@pytest.mark.parametrize(
    ("manifests", "keep", "doomed"),
    [
        ([(1, 1), (2, 1), (3, 1), (4, 1)], 2, [2]),  # base 1 kept for the kept deltas
        ([(1, 1), (2, 2), (3, 2), (4, 2)], 2, [1]),
        ([(1, 1), (2, 2)], 5, []),
        ([(1, 1), (2, 2), (3, 3)], 0, []),  # 0 keeps everything
        ([(5, 5), (1, 1), (3, 3)], 1, [1, 3]),
    ],
)
def test_plan_retention(manifests: list[tuple[int, int]], keep: int, doomed: list[int]) -> None:
    summaries = [Committed(s, b, since_full=0) for s, b in manifests]
    assert plan_retention(summaries, keep) == doomed


@pytest.mark.parametrize(
    ("committed", "keep", "doomed"),
    [
        # a new run at step 10 into a location holding 500..502 (committed earlier):
        # its own commits are the newest, and stay
        ([(500, 500, 1.0), (501, 501, 2.0), (502, 502, 3.0), (10, 10, 4.0)], 3, [500]),
        (
            [(500, 500, 1.0), (501, 501, 2.0), (502, 502, 3.0), (10, 10, 4.0), (11, 11, 5.0)],
            2,
            [500, 501, 502],
        ),
        # a kept delta's base stays, however old
        ([(500, 500, 1.0), (10, 10, 2.0), (11, 10, 3.0), (12, 10, 4.0)], 2, [500]),
        ([(500, 500, 1.0), (10, 500, 2.0), (11, 500, 3.0)], 1, [10]),
        # the same time: by step
        ([(3, 3, 1.0), (1, 1, 1.0), (2, 2, 1.0)], 2, [1]),
    ],
)
def test_plan_retention_keeps_the_last_commits_by_commit_time(
    committed: list[tuple[int, int, float]], keep: int, doomed: list[int]
) -> None:
    summaries = [Committed(s, b, since_full=0) for s, b, _ in committed]
    times = {s: t for s, _, t in committed}
    assert plan_retention(summaries, keep, committed_at=times) == doomed


def test_plan_gc_spares_referenced_and_young_objects() -> None:
    objects = [
        ObjectInfo("chunks/aa/old-orphan", 1, 0.0),
        ObjectInfo("chunks/bb/young-orphan", 1, 95.0),
        ObjectInfo("chunks/cc/old-referenced", 1, 0.0),
    ]
    got = plan_gc(objects, {"chunks/cc/old-referenced"}, now=100.0, grace_s=10.0)
    assert got == ["chunks/aa/old-orphan"]


@pytest.mark.parametrize(
    ("last_run", "now", "grace_s", "due"),
    [
        (None, 0.0, 3600.0, True),  # the persister's first: at once
        (100.0, 100.0, 0.0, True),  # no grace: after every commit
        (100.0, 399.0, 3600.0, False),  # an hour's grace: a tenth is 6 minutes...
        (100.0, 100.0 + GC_INTERVAL_CAP_S, 3600.0, True),  # ...capped at 5
        (100.0, 105.0, 60.0, False),
        (100.0, 106.0, 60.0, True),  # a tenth of the grace
    ],
)
def test_gc_runs_at_most_once_per_tenth_of_the_grace(
    last_run: float | None, now: float, grace_s: float, due: bool
) -> None:
    assert gc_due(last_run, now, grace_s) is due
