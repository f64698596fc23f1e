"""The fenced commit: a checkpoint is exactly one save of one attempt, never a mix.

Every save has an identity (``SaveIdentity``: the attempt and a nonce rank 0
drew). Each rank stores its part under it, ``parts/<step>/<save>/rank-<r>.json``;
the commit reads exactly the parts of ranks 0..W-1 of *that* save, with the
world size it planned, and writes the manifest (recording the identity) with a
create-only PUT. The parts are small (version 3: each names its rank's rank manifest,
with file sizes and totals), so the commit reads O(W) small objects, never the chunk
lists. Whatever a straggler of an earlier attempt, a second writer at
the same URI, or a half-finished save left lies under another identity and
cannot enter the commit.

    retried commit whose first PUT landed  -> reads the manifest back, sees its own
                                              identity: committed
    another save committed the step first  -> CommitConflict, said plainly
    a rank (or the commit) failed          -> ``<who>.failed`` under the save, so the
                                              other ranks learn it in seconds

The pure rules (``select_parts``, ``judge``) take plain values and are
table-tested; the rest is thin I/O around them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterable

from ..errors import (
    CheckpointError,
    CommitConflict,
    NoCheckpointError,
    ObjectExists,
    ObjectNotFound,
    SaveFailed,
)
from ..format.manifest import (
    MAX_PART_BYTES,
    Manifest,
    PartKey,
    RankFiles,
    RankManifest,
    RankPart,
    RankRef,
    SaveIdentity,
    failure_key,
    manifest_key,
    part_key,
    part_prefix,
    rank_manifest_key,
)
from ..format.policy import SavePlan
from .base import ObjectStore, read_bounded
from .repository import UnreadableManifest, rank_manifests, read_manifest

FAILURE_BYTES = 64 << 10  # a failure marker's reason is a line of text; more is not ours
log = logging.getLogger(__name__)


# -- pure rules ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Progress:
    """What the store holds of one save before its commit."""

    ranks: frozenset[int]  # ranks whose part is stored
    failed: tuple[str, ...]  # who said it failed: "rank-<r>" or "commit"


def read_progress(keys: Iterable[str], step: int, save: SaveIdentity) -> Progress:
    """Parse a listing of ``part_prefix(step, save)``."""
    ranks, failed = set(), []
    for key in keys:
        parsed = PartKey.parse(key)
        if parsed is None or parsed.step != step or parsed.save != save:
            continue
        if parsed.is_part:
            ranks.add(int(parsed.name[len("rank-") : -len(".json")]))
        elif parsed.name.endswith(".failed"):
            failed.append(parsed.name[: -len(".failed")])
    return Progress(frozenset(ranks), tuple(sorted(failed)))


def select_parts(parts: Iterable[RankPart], plan: SavePlan, world_size: int) -> list[RankPart]:
    """Exactly ranks 0..W-1 of this save, each planned for this world size; else raise."""
    by_rank: dict[int, RankPart] = {}
    for part in parts:
        if part.save != plan.save or part.step != plan.step:
            continue  # cannot happen through part_prefix; never trust a listing blindly
        if part.world_size != world_size:
            raise CheckpointError(
                f"cannot commit step {plan.step}: rank {part.rank}'s part was staged for "
                f"{part.world_size} ranks, the save planned {world_size}"
            )
        by_rank[part.rank] = part
    extra = sorted(set(by_rank) - set(range(world_size)))
    missing = sorted(set(range(world_size)) - set(by_rank))
    if extra:
        raise CheckpointError(f"cannot commit step {plan.step}: parts of unknown ranks {extra}")
    if missing:
        raise CheckpointError(f"cannot commit step {plan.step}: ranks {missing} did not upload")
    return [by_rank[r] for r in range(world_size)]


def judge(existing: Manifest, save: SaveIdentity) -> Manifest:
    """A manifest found where ours should be: ours (a retried PUT landed), or a conflict."""
    if existing.save == save:
        return existing
    who = str(existing.save) if existing.save else "a save of an older ctj"
    raise CommitConflict(
        f"step {existing.step} was already committed by another save ({who}); this save "
        f"({save}) is discarded: its checkpoint is not the one stored"
    )


# -- I/O --------------------------------------------------------------------------


def store_part(store: ObjectStore, part: RankPart) -> None:
    store.put(part_key(part.step, part.save, part.rank), part.to_bytes())


def has_part(store: ObjectStore, step: int, save: SaveIdentity, rank: int) -> bool:
    try:
        store.get(part_key(step, save, rank), byte_range=(0, 1))
        return True
    except ObjectNotFound:
        return False


def report_failure(store: ObjectStore, step: int, save: SaveIdentity, who: str, why: str) -> None:
    """Tell the other ranks (best effort: the commit timeout is the backstop)."""
    try:
        store.put(failure_key(step, save, who), json.dumps({"reason": why}).encode())
    except Exception as exc:  # noqa: BLE001 - the store may be why we failed
        log.warning("could not record the failure of step %d (%s) in the store: %s", step, who, exc)


def progress(store: ObjectStore, step: int, save: SaveIdentity) -> Progress:
    return read_progress((o.key for o in store.list(part_prefix(step, save))), step, save)


def failure_reasons(store: ObjectStore, step: int, save: SaveIdentity, who: Iterable[str]) -> str:
    reasons = []
    for name in who:
        try:
            raw = json.loads(read_bounded(store, failure_key(step, save, name), FAILURE_BYTES))
            reasons.append(f"{name}: {raw.get('reason', '?')}")
        except (ObjectNotFound, ValueError, AttributeError):
            reasons.append(f"{name}: failed")
    return "; ".join(reasons)


def commit(
    store: ObjectStore,
    plan: SavePlan,
    *,
    world_size: int,
    block_size: int,
    timings: dict[str, float],
    versions: dict[str, str],
) -> Manifest:
    """Write the manifest of this one save from its ranks' parts; raises if it can't.

    Chunks a rank did not upload were named by its reference manifest when it
    read it; a retired reference keeps them for the gc grace, so they are there.
    """
    prefix = part_prefix(plan.step, plan.save)
    keys = [o.key for o in store.list(prefix) if o.key.endswith(".json")]
    parts = select_parts(
        (RankPart.from_bytes(read_bounded(store, k, MAX_PART_BYTES)) for k in keys),
        plan,
        world_size,
    )
    shares = [share_of(store, p, block_size) for p in parts]
    manifest = Manifest(
        step=plan.step,
        mode=plan.mode,
        parent_step=plan.parent_step,
        base_step=plan.base_step,
        since_full=plan.since_full,
        world_size=world_size,
        block_size=block_size,
        files=RankFiles(
            tuple(shares),
            step=plan.step,
            save=plan.save,
            block_size=block_size,
            fetch=rank_manifests(store),
        ),
        logical_bytes=sum(s.logical_bytes for s in shares),
        uploaded_bytes=sum(p.uploaded_bytes for p in parts),
        deduplicated_bytes=sum(p.deduplicated_bytes for p in parts),
        created=time.time(),
        timings=dict(timings, upload_max=max(p.upload_seconds for p in parts)),
        versions=versions,
        save=plan.save,
    )
    try:
        store.put(manifest_key(plan.step), manifest.to_bytes(), if_absent=True)
    except ObjectExists:
        log.info("step %d: a manifest is there already; reading it back", plan.step)
    # read back, always: a retried PUT that had landed is ours; a server that let another
    # committer overwrite (a weaker mode, see store/s3.py) is caught here, not later
    manifest = judge(read_manifest(store, plan.step), plan.save)
    store.delete(o.key for o in store.list(prefix))
    return manifest


def share_of(store: ObjectStore, part: RankPart, block_size: int) -> RankRef:
    """What the manifest says of a part's rank. A version 2 part (stored by an older ctj
    before an upgrade) carries its chunk lists: they are written as its rank manifest."""
    if part.inline is None:
        return part.share()
    body = RankManifest(
        step=part.step, rank=part.rank, save=part.save, block_size=block_size, files=part.inline
    ).to_bytes()
    converted = RankPart.of(
        RankManifest.from_bytes(body),
        body,
        world_size=part.world_size,
        uploaded_bytes=part.uploaded_bytes,
        deduplicated_bytes=part.deduplicated_bytes,
        upload_seconds=part.upload_seconds,
    )
    store.put(rank_manifest_key(converted.manifest), body)
    return converted.share()


def outcome(store: ObjectStore, step: int, save: SaveIdentity) -> Manifest | SaveFailed | None:
    """What became of one save: its manifest, why it failed, or None while in flight.

    A retired manifest counts only if it is this save's (retention may retire a
    commit at once); one of an earlier save at the same step is history, not an
    answer.
    """
    try:
        return judge(read_manifest(store, step), save)
    except NoCheckpointError:
        pass
    except SaveFailed as exc:
        return exc
    except UnreadableManifest as exc:  # the step is taken, by no manifest anyone can read
        return SaveFailed(f"save of step {step} cannot commit: {exc}")
    try:
        retired = read_manifest(store, step, retired_too=True)
        if retired.save == save:
            return retired
    except (NoCheckpointError, UnreadableManifest):
        pass
    state = progress(store, step, save)
    if state.failed:
        return SaveFailed(
            f"save of step {step} failed ({failure_reasons(store, step, save, state.failed)})"
        )
    return None
