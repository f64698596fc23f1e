"""Operations on a checkpoint location: list, read, commit, retention, gc, remove.

Everything here is a thin adapter between the object store and the pure rules
in policy.py. The commit (commit.py) is one create-only write of the manifest;
nothing else makes a checkpoint visible.

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
    PartKey,
    RankPart,
    SaveIdentity,
    manifest_key,
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
    committed_saves: dict[int, SaveIdentity | None] = {}
    for step in committed_steps(store):
        manifest = read_manifest(store, step)
        referenced |= _chunk_keys(manifest.files, f"step {step}")
        committed_saves[step] = manifest.save
    old_retired = []
    for obj in store.list(RETIRED):
        if now - obj.last_modified >= grace_s:
            old_retired.append(obj.key)
            continue
        try:
            retired = Manifest.from_bytes(store.get(obj.key))
        except ObjectNotFound:
            continue
        referenced |= _chunk_keys(retired.files, obj.key)
    part_objects = list(store.list(PARTS))
    stale_parts = []
    for obj in part_objects:
        parsed = PartKey.parse(obj.key)
        if parsed is None:
            continue
        if parsed.step in committed_saves and parsed.save == committed_saves[parsed.step]:
            stale_parts.append(obj.key)  # the committed save's: a cleanup was interrupted
            continue
        if now - obj.last_modified >= grace_s:
            stale_parts.append(obj.key)  # a save that never committed (or lost): aged out
            continue
        if not parsed.is_part:
            continue
        try:  # possibly in flight: what it names stays
            part = RankPart.from_bytes(store.get(obj.key))
        except (ObjectNotFound, ValueError, KeyError, TypeError):
            continue
        referenced |= _chunk_keys(part.files, obj.key)
    chunks = list(store.list(CHUNKS))
    doomed = set(policy.plan_gc(chunks, referenced, now=now, grace_s=grace_s))
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


def _chunk_keys(files: dict[str, FileEntry], where: str) -> set[str]:
    """The stored objects a record names; a codec this ctj does not know stops gc (it
    cannot name that object, and must not delete it for want of a name)."""
    try:
        return {c.key for f in files.values() for c in f.chunks}
    except ValueError as exc:
        raise CheckpointError(
            f"gc stopped, nothing deleted: {where} names a chunk codec this ctj does not "
            f"know ({exc}); upgrade ctj"
        ) from None


def remove(store: ObjectStore, steps: list[int]) -> None:
    existing = set(committed_steps(store))
    unknown = [s for s in steps if s not in existing]
    if unknown:
        raise NoCheckpointError(f"no committed checkpoint at step(s) {unknown}")
    retire(store, steps)
