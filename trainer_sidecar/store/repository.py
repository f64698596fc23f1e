"""Operations on a checkpoint location: list, read, commit, retention, gc, remove.

Everything here is a thin adapter between the object store and the pure rules
in policy.py. The commit (commit.py) is one create-only write of the manifest;
nothing else makes a checkpoint visible.

A version 3 manifest reads its rank manifests (each rank's chunk lists) only when
asked: listing and retention never do; gc reads them all, since it must mark every
chunk, and sweeps rank manifests nobody names like chunks.

Removing a checkpoint (retention or ``rm``) *retires* its manifest: it moves to
``retired/`` and its chunks stay live for the gc grace period. A save in flight
may have deduplicated against it a moment ago; the grace (longer than any
save takes) is what keeps those chunks in place until that save commits.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    NoCheckpointError,
    ObjectNotFound,
)
from ..format import policy
from ..format.manifest import (
    CHUNKS,
    MANIFESTS,
    MAX_MANIFEST_BYTES,
    MAX_PART_BYTES,
    MAX_RANK_MANIFEST_BYTES,
    PARTS,
    RANKS,
    RETIRED,
    FileEntry,
    Manifest,
    PartKey,
    RankPart,
    SaveIdentity,
    manifest_key,
    open_rank_manifest,
    retired_key,
    step_of_manifest_key,
)
from .base import ObjectStore, bounded_reader, read_bounded
from .gc_fence import MARKERS, GcRun, forgettable, runs_in, store_now

log = logging.getLogger(__name__)


def committed_steps(store: ObjectStore) -> list[int]:
    steps = (step_of_manifest_key(o.key) for o in store.list(MANIFESTS))
    return sorted(s for s in steps if s is not None)


class UnreadableManifest(CheckpointError):
    """A committed manifest whose bytes are no manifest this ctj can read: the step and why
    (``ctj checkpoints ls/show/verify`` report it as a row and go on with the rest)."""

    def __init__(self, step: int, reason: str) -> None:
        super().__init__(f"manifest of step {step} is unreadable: {reason}")
        self.step = step
        self.reason = reason

    def __reduce__(self) -> tuple[object, ...]:
        return type(self), (self.step, self.reason)


def rank_manifests(store: ObjectStore) -> Callable[[str], bytes]:
    """How a manifest fetches its rank manifests: each read no further than the largest
    one may be (docs/format.md, Limits)."""
    return bounded_reader(store, MAX_RANK_MANIFEST_BYTES)


def read_manifest(store: ObjectStore, step: int, *, retired_too: bool = False) -> Manifest:
    try:
        data = read_bounded(store, manifest_key(step), MAX_MANIFEST_BYTES)
    except ObjectNotFound:
        try:
            if not retired_too:
                raise
            data = read_bounded(store, retired_key(step), MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            raise NoCheckpointError(f"no committed checkpoint at step {step}") from None
    try:
        return Manifest.from_bytes(data, fetch=rank_manifests(store))
    except (
        ValueError,
        LookupError,
        TypeError,
        AttributeError,
        ArithmeticError,
        RecursionError,
    ) as exc:  # whatever the bytes hold (json nested past the stack, inf as an int...)
        raise UnreadableManifest(step, str(exc)) from None


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
    """Retire all but the last ``keep_last`` commits by commit time (and their bases): the
    manifest's own ``created``, or, for one that cannot be read, the store's Last-Modified."""
    stored = {
        step: o.last_modified
        for o in store.list(MANIFESTS)
        if (step := step_of_manifest_key(o.key)) is not None
    }
    summaries, committed_at = [], {}
    for step in sorted(stored):
        try:
            manifest = read_manifest(store, step)
        except NoCheckpointError:  # retired meanwhile (a concurrent retention, `rm`)
            continue
        except CheckpointError:  # unreadable: keep it only for itself
            summaries.append(policy.Committed(step, step, 0))
            committed_at[step] = stored[step]
            continue
        summaries.append(policy.Committed.of(manifest))
        committed_at[step] = manifest.created
    doomed = policy.plan_retention(summaries, keep_last, committed_at=committed_at)
    retire(store, doomed)
    return doomed


def retire(store: ObjectStore, steps: list[int]) -> None:
    """Move manifests to retired/: no longer checkpoints, chunks live for the grace."""
    for step in steps:
        try:
            data = read_bounded(store, manifest_key(step), MAX_MANIFEST_BYTES)
        except ObjectNotFound:
            continue
        store.put(retired_key(step), data)
        store.delete([manifest_key(step)])


@dataclasses.dataclass(frozen=True, slots=True)
class GcReport:
    deleted_chunks: int
    deleted_bytes: int
    deleted_parts: int
    kept_chunks: int
    deleted_rank_manifests: int = 0


def _named(manifest: Manifest, fix: str) -> set[str]:
    """Every object a checkpoint needs: its chunks and (version 3) its rank manifests. One
    whose chunks cannot all be read stops gc before it deletes anything: what it names is
    unknown, so nothing is provably unreferenced."""
    try:
        return _chunk_keys(manifest.files, f"step {manifest.step}") | manifest.rank_keys()
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"gc stopped, nothing deleted: {exc} ({fix})") from None


def _named_by_part(store: ObjectStore, part: RankPart) -> set[str]:
    """What a part possibly in flight names: its rank manifest and that one's chunks."""
    if part.inline is not None:  # version 2: inline
        return _chunk_keys(part.inline, f"a part of step {part.step}")
    share = part.share()
    try:
        files = open_rank_manifest(
            read_bounded(store, share.key, MAX_RANK_MANIFEST_BYTES),
            share,
            step=part.step,
            save=part.save,
            block_size=None,
        )
    except (ObjectNotFound, ValueError):
        return {share.key}  # nothing it names can be read: it cannot commit either
    return {share.key} | _chunk_keys(files, f"a part of step {part.step}")


@dataclasses.dataclass(frozen=True, slots=True)
class _Marked:
    referenced: set[str]  # every chunk and rank manifest something live names
    stale_parts: list[str]  # parts and failure markers no save can still use
    old_retired: list[str]  # retired manifests past the grace


def _mark(store: ObjectStore, *, now: float, grace_s: float) -> _Marked:
    """What live manifests, young retired ones and parts possibly in flight name."""
    referenced: set[str] = set()
    committed_saves: dict[int, SaveIdentity | None] = {}
    for step in committed_steps(store):
        manifest = read_manifest(store, step)
        referenced |= _named(manifest, f"`ctj checkpoints rm {step}` removes it")
        committed_saves[step] = manifest.save
    old_retired = []
    for obj in store.list(RETIRED):
        if now - obj.last_modified >= grace_s:
            old_retired.append(obj.key)
            continue
        try:
            data = read_bounded(store, obj.key, MAX_MANIFEST_BYTES)
            retired = Manifest.from_bytes(data, fetch=rank_manifests(store))
        except ObjectNotFound:
            continue
        except (CheckpointError, ValueError, KeyError, TypeError, AttributeError) as exc:
            # nothing a save relies on: a save that read it as a reference failed to, and
            # uploaded every chunk; it ages out like the others
            log.warning(
                "gc: retired manifest %s is unreadable (%s); it names nothing", obj.key, exc
            )
            continue
        referenced |= _named(retired, "it leaves after the grace")
    stale_parts = []
    for obj in store.list(PARTS):
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
            part = RankPart.from_bytes(read_bounded(store, obj.key, MAX_PART_BYTES))
        except (ObjectNotFound, ValueError, KeyError, TypeError):
            continue
        referenced |= _named_by_part(store, part)
    return _Marked(referenced, stale_parts, old_retired)


def collect_garbage(store: ObjectStore, *, grace_s: float, dry_run: bool = False) -> GcReport:
    """Mark every chunk and rank manifest that a manifest, a young retired manifest or an
    in-flight part names; sweep the rest past grace, behind the gc fence (gc_fence.py:
    what may go is published before the holds of saves in flight are read and before the
    first delete)."""
    now = store_now(store)
    marked = _mark(store, now=now, grace_s=grace_s)
    chunks = list(store.list(CHUNKS))
    doomed = policy.plan_gc(chunks, marked.referenced, now=now, grace_s=grace_s)
    # rank manifests of saves that never committed go like chunks: unnamed, past the grace
    doomed_ranks = policy.plan_gc(store.list(RANKS), marked.referenced, now=now, grace_s=grace_s)
    if dry_run:
        deleted = {*doomed, *doomed_ranks}
    else:
        run = GcRun(store)
        others = list(runs_in(store.list(MARKERS)).values())
        deleted = set(run.sweep([*doomed, *doomed_ranks], now=now, grace_s=grace_s))
        forget = forgettable(others, now=now, grace_s=grace_s)
        run.delete_unfenced([*marked.stale_parts, *marked.old_retired, *forget])
        run.done()
    return GcReport(
        deleted_chunks=sum(1 for k in doomed if k in deleted),
        deleted_bytes=sum(o.size for o in chunks if o.key in deleted),
        deleted_parts=len(marked.stale_parts),
        kept_chunks=len(chunks) - sum(1 for k in doomed if k in deleted),
        deleted_rank_manifests=sum(1 for k in doomed_ranks if k in deleted),
    )


def _chunk_keys(files: Mapping[str, FileEntry], where: str) -> set[str]:
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
