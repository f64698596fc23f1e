"""Operations on a checkpoint location: list, read, commit, retention, gc, remove.

Everything here is a thin adapter between the object store and the pure rules
in policy.py. The commit is one create-only write of the manifest; nothing
else makes a checkpoint visible.

Removing a checkpoint (retention or ``rm``) *retires* its manifest: it moves to
``retired/`` and its chunks stay live for the gc grace period. A save in flight
may have deduplicated against it a moment ago; the grace (longer than any
save takes) is what keeps those chunks in place until that save commits.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from ..errors import (
    CheckpointError,
    NoCheckpointError,
    ObjectExists,
    ObjectNotFound,
)
from ..format import policy
from ..format.manifest import (
    CHUNKS,
    MANIFESTS,
    PARTS,
    RETIRED,
    FileEntry,
    Manifest,
    RankPart,
    manifest_key,
    part_prefix,
    retired_key,
    step_of_manifest_key,
)
from .base import ObjectStore

log = logging.getLogger(__name__)
CLOCK_KEY = "clock"


def committed_steps(store: ObjectStore) -> list[int]:
    steps = (step_of_manifest_key(o.key) for o in store.list(MANIFESTS))
    return sorted(s for s in steps if s is not None)


def read_manifest(store: ObjectStore, step: int, *, retired_too: bool = False) -> Manifest:
    try:
        data = store.get(manifest_key(step))
    except ObjectNotFound:
        try:
            if not retired_too:
                raise
            data = store.get(retired_key(step))
        except ObjectNotFound:
            raise NoCheckpointError(f"no committed checkpoint at step {step}") from None
    try:
        return Manifest.from_bytes(data)
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"manifest of step {step} is unreadable: {exc}") from None


def latest_manifest(store: ObjectStore, *, before: int | None = None) -> Manifest | None:
    """The newest readable manifest (with step < ``before`` if given)."""
    for step in reversed(committed_steps(store)):
        if before is not None and step >= before:
            continue
        try:
            return read_manifest(store, step)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %d: %s", step, exc)
    return None


def read_parts(store: ObjectStore, step: int) -> list[RankPart]:
    return [RankPart.from_bytes(store.get(o.key)) for o in store.list(part_prefix(step))]


def commit(
    store: ObjectStore,
    plan: policy.SavePlan,
    *,
    world_size: int,
    block_size: int,
    timings: dict[str, float],
    versions: dict[str, str],
) -> Manifest:
    """Write the manifest from every rank's part; raises if a part is missing.

    Chunks a rank did not upload were named by its reference manifest when it
    read it; a retired reference keeps them for the gc grace, so they are there.
    """
    parts = read_parts(store, plan.step)
    ranks = {p.rank for p in parts}
    missing = sorted(set(range(world_size)) - ranks)
    if missing:
        raise CheckpointError(f"cannot commit step {plan.step}: ranks {missing} did not upload")
    files: dict[str, FileEntry] = {}
    for part in parts:
        files.update(part.files)
    timings = dict(timings, upload_max=max(p.upload_seconds for p in parts))
    manifest = Manifest(
        step=plan.step,
        mode=plan.mode,
        parent_step=plan.parent_step,
        base_step=plan.base_step,
        since_full=plan.since_full,
        world_size=world_size,
        block_size=block_size,
        files=files,
        logical_bytes=sum(f.size for f in files.values()),
        uploaded_bytes=sum(p.uploaded_bytes for p in parts),
        deduplicated_bytes=sum(p.deduplicated_bytes for p in parts),
        created=time.time(),
        timings=timings,
        versions=versions,
    )
    try:
        store.put(manifest_key(plan.step), manifest.to_bytes(), if_absent=True)
    except ObjectExists:
        raise CheckpointError(
            f"step {plan.step} is already committed at this location; a commit never overwrites"
        ) from None
    store.delete(o.key for o in store.list(part_prefix(plan.step)))
    return manifest


def apply_retention(store: ObjectStore, keep_last: int) -> list[int]:
    summaries = []
    for step in committed_steps(store):
        try:
            summaries.append(policy.Committed.of(read_manifest(store, step)))
        except CheckpointError:  # unreadable: keep it only for itself
            summaries.append(policy.Committed(step, step, 0))
    doomed = policy.plan_retention(summaries, keep_last)
    retire(store, doomed)
    return doomed


def retire(store: ObjectStore, steps: list[int]) -> None:
    """Move manifests to retired/: no longer checkpoints, chunks live for the grace."""
    for step in steps:
        try:
            data = store.get(manifest_key(step))
        except ObjectNotFound:
            continue
        store.put(retired_key(step), data)
        store.delete([manifest_key(step)])


def store_now(store: ObjectStore) -> float:
    """The store's own clock (object ages are on it), read by writing a tiny object."""
    store.put(CLOCK_KEY, b"")
    for info in store.list(CLOCK_KEY):
        if info.key == CLOCK_KEY:
            return info.last_modified
    return time.time()


@dataclasses.dataclass(frozen=True, slots=True)
class GcReport:
    deleted_chunks: int
    deleted_bytes: int
    deleted_parts: int
    kept_chunks: int


def collect_garbage(store: ObjectStore, *, grace_s: float, dry_run: bool = False) -> GcReport:
    """Mark every chunk a manifest, a young retired manifest or an in-flight part names;
    sweep the rest past grace."""
    now = store_now(store)
    referenced: set[str] = set()
    committed = set(committed_steps(store))
    for step in committed:
        referenced |= read_manifest(store, step).chunk_keys()
    old_retired = []
    for obj in store.list(RETIRED):
        if now - obj.last_modified >= grace_s:
            old_retired.append(obj.key)
            continue
        try:
            referenced |= Manifest.from_bytes(store.get(obj.key)).chunk_keys()
        except ObjectNotFound:
            continue
    part_objects = list(store.list(PARTS))
    for obj in part_objects:
        try:
            part = RankPart.from_bytes(store.get(obj.key))
        except ObjectNotFound:
            continue
        referenced |= {c.key for f in part.files.values() for c in f.chunks}
    chunks = list(store.list(CHUNKS))
    doomed = set(policy.plan_gc(chunks, referenced, now=now, grace_s=grace_s))
    # parts of committed steps are leftovers of an interrupted cleanup; others age out
    stale_parts = [
        o.key
        for o in part_objects
        if int(o.key[len(PARTS) :].split("/")[0]) in committed or now - o.last_modified >= grace_s
    ]
    if not dry_run:
        store.delete(sorted(doomed))
        store.delete(stale_parts)
        store.delete(old_retired)
    return GcReport(
        deleted_chunks=len(doomed),
        deleted_bytes=sum(o.size for o in chunks if o.key in doomed),
        deleted_parts=len(stale_parts),
        kept_chunks=len(chunks) - len(doomed),
    )


def remove(store: ObjectStore, steps: list[int]) -> None:
    existing = set(committed_steps(store))
    unknown = [s for s in steps if s not in existing]
    if unknown:
        raise NoCheckpointError(f"no committed checkpoint at step(s) {unknown}")
    retire(store, steps)
