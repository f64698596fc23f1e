"""Restore: load the newest usable committed checkpoint into the caller's state, in place.

For each candidate, newest first, rank 0 alone reads its manifest (version 3: the
small top-level one, then rank 0's rank manifest, which holds ``.metadata``) and its DCP
``.metadata`` (unpickled by the allow-list, checked against the manifest) and
hands every rank the parsed result, so all ranks load the same checkpoint or
skip it together. DCP's planner then decides what each rank needs (resharding
included); the reader fetches exactly those byte ranges, verified, and the
planner decodes non-tensor values by ``weights_only`` rules.

A checkpoint that is unusable (an unreadable manifest, a missing or refused
``.metadata``, a chunk missing or failing its hash, a value weights_only
refuses) is skipped, loudly, and the previous one is tried. DCP gathers a read
failure on any rank to every rank, so that decision is the same everywhere.
Anything else surfaces as itself: a store that cannot be reached is not "a
checkpoint that does not match", and a state that does not match is not
"corrupt".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import set_state_dict

from .. import collectives
from ..errors import CheckpointError, CorruptCheckpointError, NoCheckpointError
from ..format.manifest import Manifest
from ..metrics import CheckpointMetrics
from ..state_dict import build_state
from ..store import repository
from ..store.base import ObjectStore
from .checks import bind, read_manifest
from .chunk_reader import ChunkReader
from .dcp_reader import ChunkedStorageReader, read_checked_metadata
from .planner import SafeLoadPlanner, StateMismatch
from .tiers import ChunkTiers

log = logging.getLogger("ctj.checkpoint")


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    step: int
    extra: dict[str, Any]
    skipped: tuple[int, ...]  # newer checkpoints that were unusable
    bytes_fetched: int
    seconds: float
    bytes_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    """This rank's bytes by tier (local, peer, s3); rank 0's include the ``.metadata``."""
    saved_world_size: int = 0
    """The world size that saved it (the ranks of its manifest): another than the loading
    one's means the load resharded."""
    source: str | None = None
    """Where it was loaded from when not the run's own location: the resume source (a job
    seeded by spec.checkpoint.resumeFrom); None for the run's own checkpoints."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RestoreSettings:
    parallelism: int = 8
    """Concurrent ranged GETs per rank."""
    trust_pickled_values: bool = False
    """Unpickle non-tensor values without weights_only's restrictions (see CheckpointConfig)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Opened:
    """A candidate rank 0 found usable: its manifest and checked metadata."""

    manifest: Manifest
    metadata: Metadata
    metadata_bytes: int  # what rank 0 fetched to read it
    metadata_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class Unusable:
    """A candidate rank 0 found unusable, and why (one line naming the step)."""

    step: int
    reason: str


def open_checkpoint(
    store: ObjectStore, step: int, *, parallelism: int = 8, tiers: ChunkTiers | None = None
) -> Opened | Unusable:
    """Read and check one candidate's manifest and metadata (rank 0's part of a restore).

    Store errors (unreachable, credentials) are raised: they say nothing about the
    checkpoint. Everything wrong with the checkpoint itself is an ``Unusable``.
    """
    try:
        manifest = read_manifest(store, step)
        reader = ChunkReader(store, manifest, parallelism=parallelism, tiers=tiers)
        metadata = read_checked_metadata(reader)
    except NoCheckpointError:
        return Unusable(step, f"checkpoint step {step} is gone (removed while loading)")
    except CorruptCheckpointError as exc:  # UnsafeCheckpointError among them
        return Unusable(step, str(exc))
    return Opened(manifest, metadata, reader.stats.bytes_fetched, dict(reader.stats.by_tier))


def _wrapped(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and what it wraps: DCP's per-rank failures (in rank order), then causes."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        if isinstance(current, CheckpointException):
            for rank in sorted(current.failures):
                failure = current.failures[rank]
                inner = failure[0] if isinstance(failure, tuple) else failure
                if isinstance(inner, BaseException):
                    todo.append(inner)
        nested = current.__cause__ or current.__context__
        if nested is not None:
            todo.append(nested)


def find_corruption(exc: BaseException) -> CorruptCheckpointError | None:
    """The CorruptCheckpointError behind a (possibly DCP-wrapped) exception."""
    return next((e for e in _wrapped(exc) if isinstance(e, CorruptCheckpointError)), None)


def real_error(exc: BaseException) -> BaseException:
    """What a failed load should raise, when the checkpoint is not corrupt: a state
    mismatch as such, else the first of our own errors (the store is unreachable, ...),
    else the first error DCP wrapped, as itself."""
    found = list(_wrapped(exc))
    for kind in (StateMismatch, CheckpointError):
        hit = next((e for e in found if isinstance(e, kind)), None)
        if hit is not None:
            return hit
    return next((e for e in found if not isinstance(e, CheckpointException)), exc)


def restore(
    store: ObjectStore,
    *,
    model: torch.nn.Module,
    optimizer: Any,
    extra: dict[str, Any] | None,
    step: int | None,
    settings: RestoreSettings,
    metrics: CheckpointMetrics,
    group: Any = None,
    tiers: ChunkTiers | None = None,
) -> LoadResult | None:
    """Collective: every rank calls it; returns None when nothing is committed.
    ``tiers``: the node's and the peers' chunk caches, read before the store."""
    started = time.monotonic()

    def candidates() -> list[int]:
        return [s for s in reversed(repository.committed_steps(store)) if step is None or s <= step]

    steps = collectives.decided_by_rank0(candidates, group)
    if not steps:
        return None
    skipped: list[tuple[int, str]] = []

    def skip(candidate: int, reason: str) -> None:
        metrics.count_failure("restore")
        older = steps[len(skipped) + 1] if len(skipped) + 1 < len(steps) else None
        then = f"loading step {older} instead" if older is not None else "no older checkpoint"
        log.warning("%s: skipped it; %s", reason, then)
        skipped.append((candidate, reason))

    for candidate in steps:
        opened = collectives.decided_by_rank0(
            functools.partial(
                open_checkpoint, store, candidate, parallelism=settings.parallelism, tiers=tiers
            ),
            group,
        )
        if isinstance(opened, Unusable):
            skip(candidate, opened.reason)
            continue
        state = build_state(model, optimizer, extra)  # afresh: a failed try may have filled some
        # only the rank manifests of the files this rank's plan touches are read (version 3)
        reader = ChunkReader(
            store, bind(store, opened.manifest), parallelism=settings.parallelism, tiers=tiers
        )
        planner = SafeLoadPlanner(
            step=candidate, trust_pickled_values=settings.trust_pickled_values
        )
        try:
            dcp.load(
                state,
                storage_reader=ChunkedStorageReader(reader, metadata=opened.metadata),
                planner=planner,
                process_group=group,
            )
        except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
            corrupt = find_corruption(exc)
            if corrupt is not None:
                skip(candidate, str(corrupt))
                continue
            error = real_error(exc)
            if isinstance(error, StateMismatch):
                raise StateMismatch(str(error)) from None
            if error is exc:
                raise
            raise error from exc
        try:
            set_state_dict(
                model,
                [] if optimizer is None else [optimizer],
                model_state_dict=state["model"],
                optim_state_dict=state.get("optim", {}),
            )
        except Exception as exc:  # noqa: BLE001 - DCP loaded it: the state's structure differs
            raise StateMismatch(
                f"checkpoint step {candidate} does not match the state being loaded "
                f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}): "
                "load it into the same model and optimizer that saved it"
            ) from exc
        if extra is not None:
            extra.update(state["extra"])
        seconds = time.monotonic() - started
        metrics.observe_restore(seconds, collectives.rank(group))
        fetched, by_tier = reader.stats.bytes_fetched, dict(reader.stats.by_tier)
        if collectives.rank(group) == 0:
            fetched += opened.metadata_bytes
            for tier, n in opened.metadata_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        metrics.count_restore_bytes(by_tier)
        return LoadResult(
            step=candidate,
            extra=state["extra"],
            skipped=tuple(s for s, _ in skipped),
            bytes_fetched=fetched,
            seconds=seconds,
            bytes_by_tier=by_tier,
            saved_world_size=opened.manifest.world_size,
        )
    reasons = "; ".join(reason for _, reason in skipped[:3])
    more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
    raise CheckpointError(
        f"no usable checkpoint: all {len(steps)} committed checkpoints are unusable: "
        f"{reasons}{more} (see the warnings above; `ctj checkpoints verify --all` checks each)"
    )
