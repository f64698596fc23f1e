"""Pure decisions of the checkpoint store: what kind of save, what to keep, what to delete.

No I/O here; each function takes plain values and returns a plan, so the rules
are table-tested in tests/unit/test_policy.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .manifest import Manifest, Mode, SaveIdentity


class StoredObject(Protocol):
    """What gc's decision needs of a listed object (the store's ObjectInfo has it)."""

    @property
    def key(self) -> str: ...

    @property
    def last_modified(self) -> float: ...


@dataclasses.dataclass(frozen=True, slots=True)
class Committed:
    """What planning (the latest commit) and retention (every commit) need of a checkpoint."""

    step: int
    base_step: int
    since_full: int

    @classmethod
    def of(cls, manifest: Manifest) -> Committed:
        return cls(manifest.step, manifest.base_step, manifest.since_full)


@dataclasses.dataclass(frozen=True, slots=True)
class SavePlan:
    step: int
    mode: Mode  # what this save actually does: full | incremental | differential
    parent_step: int | None  # latest committed checkpoint before this one
    base_step: int  # last full checkpoint (this step itself when mode is full)
    since_full: int
    reference_step: int | None  # whose chunks need no upload (None: upload all)
    save: SaveIdentity  # who this save is: its parts and its manifest carry it

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "save": self.save.to_json()}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> SavePlan:
        save = SaveIdentity.from_json(raw["save"])
        return cls(**{**raw, "mode": Mode(raw["mode"]), "save": save})


def plan_save(
    step: int, *, mode: Mode, full_every: int, latest: Committed | None, save: SaveIdentity
) -> SavePlan:
    """Full when asked, when there is nothing to build on, or every ``full_every`` saves.

    ``latest`` may lag behind a commit still in flight: the delta is then taken
    against an older checkpoint, which costs bytes, never correctness.
    """
    if latest is None or mode == Mode.FULL or latest.since_full + 1 >= full_every:
        return SavePlan(step, Mode.FULL, latest.step if latest else None, step, 0, None, save)
    reference = latest.step if mode == Mode.INCREMENTAL else latest.base_step
    return SavePlan(
        step, Mode(mode), latest.step, latest.base_step, latest.since_full + 1, reference, save
    )


def reference_ranks(rank: int, world_size: int, reference_world_size: int) -> range:
    """The reference checkpoint's ranks whose chunks a saving rank deduplicates against.

    At an unchanged world size, its own: a rank saves what it saved last time (DCP plans
    the same layout), so its own chunk lists are all it can reuse. At another world size
    (the first save after a resize), the old ranks at its position in rank order (rank r
    of W covers [r/W, (r+1)/W)): where DCP's even sharding put the rows it now holds, so
    the chunks most likely to recur (1024 -> 512: old ranks 2r and 2r+1; 1024 -> 2048: old
    rank r // 2). Reading every old rank instead would cost each rank the whole job's
    chunk lists for one save's worth of deduplication; missing a match costs bytes
    uploaded once, never correctness.
    """
    if reference_world_size == world_size:
        return range(rank, rank + 1)
    low = rank * reference_world_size // world_size
    high = -(-(rank + 1) * reference_world_size // world_size)
    return range(min(low, reference_world_size - 1), min(max(high, low + 1), reference_world_size))


def plan_retention(
    manifests: Sequence[Committed],
    keep_last: int,
    *,
    committed_at: Mapping[int, float] | None = None,
) -> list[int]:
    """Steps to delete so the last ``keep_last`` commits remain, with every base a kept one
    names; in step order.

    "Last" is by commit time (``committed_at``: step -> when it was committed; the same
    time, or none given, goes by step), never by step alone: a run that starts below the
    steps a location holds (a new run at step 10 beside 500..502) must not have the commits
    it just reported retired as the oldest.
    """
    if keep_last <= 0:
        return []
    times = committed_at or {}
    by_time = sorted(manifests, key=lambda m: (times.get(m.step, float("-inf")), m.step))
    kept = by_time[-keep_last:]
    keep = {m.step for m in kept} | {m.base_step for m in kept}
    return sorted(m.step for m in manifests if m.step not in keep)


def plan_gc(
    objects: Iterable[StoredObject], referenced: set[str], *, now: float, grace_s: float
) -> list[str]:
    """Unreferenced objects old enough that no save in flight can still be writing them.

    A save uploads chunks before any record names them; the grace period (longer
    than any save takes) is what keeps those safe.
    """
    return [o.key for o in objects if o.key not in referenced and now - o.last_modified >= grace_s]


GC_INTERVAL_CAP_S = 300.0
"""The longest a commit leaves gc owed (gc_due): at most 5 minutes past the grace."""


def gc_due(last_run: float | None, now: float, grace_s: float) -> bool:
    """Whether a commit that owes gc (retention retired something) runs it now.

    Nothing unnamed goes before it is ``grace_s`` old, so a run sooner than a tenth of the
    grace after the last frees little earlier; yet every run lists every chunk and reads
    every retired manifest still in its grace, which grows with the saves made within it
    (with a save every 3 s and the default hour, about 1,200 manifests and 35,000 chunks,
    after every commit). So at most once per ``min(grace_s / 10, GC_INTERVAL_CAP_S)``:
    storage held at most that long past the grace. ``last_run`` None (none yet): now.
    """
    return last_run is None or now - last_run >= min(grace_s / 10, GC_INTERVAL_CAP_S)
