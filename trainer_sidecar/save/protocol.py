"""Reusing a save's layout: DCP plans a save once, later saves skip its collectives.

DCP's save gathers every rank's plan on the coordinator, deduplicates and merges
them, scatters the result, copies, gathers the write results and writes the
metadata: several collectives and a good deal of Python on every save, all of it
decided by the state's layout alone (names, shapes, dtypes, shards). While no
rank's layout changes, those decisions do not either, so a save copies straight
into its slot in the last save's item order and reuses its metadata, updating
only where the non-tensor values (whose byte sizes change) now lie.

Whether every rank still matches is decided together, from the one exchange a
save makes anyway (``SaveReport``, see Checkpointer.save): one rank's change
makes every rank replan.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Sequence
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CheckpointError
from ..format.policy import SavePlan
from .staging import StagingWriter


@dataclasses.dataclass(frozen=True, slots=True)
class Layout:
    """What DCP decided for this rank's last planned save."""

    local_items: tuple[WriteItem, ...]  # the rank's local plan: what must stay equal
    tensor_items: tuple[WriteItem, ...]  # what the global plan left to this rank, file order
    byte_items: tuple[WriteItem, ...]
    metadata: Metadata | None  # the coordinator's; None on other ranks

    @classmethod
    def of(cls, writer: StagingWriter) -> Layout:
        return cls(writer.local_items, writer.tensor_items, writer.byte_items, writer.metadata)

    def matches(self, local_items: Sequence[WriteItem]) -> bool:
        return self.local_items == tuple(local_items)


def local_plan(
    state: dict[str, Any], *, is_coordinator: bool
) -> tuple[DefaultSavePlanner, tuple[WriteItem, ...]]:
    """DCP's own planner over ``state`` and this rank's local plan (no collectives)."""
    planner = DefaultSavePlanner()
    planner.set_up_planner(state, is_coordinator=is_coordinator)
    return planner, tuple(planner.create_local_plan().items)


def merged_metadata(metadata: Metadata, byte_results: Iterable[WriteResult]) -> Metadata:
    """The last planned save's metadata with the non-tensor values where they lie now."""
    storage = dict(metadata.storage_data or {})
    storage.update({r.index: r.storage_data for r in byte_results})
    return dataclasses.replace(metadata, storage_data=storage)


class SlotState(enum.Enum):
    FREE = "free"
    BUSY = "busy"  # the previous save still uploads (busy_policy "skip")
    TIMED_OUT = "timed out"  # no slot freed up within slot_wait_timeout_s ("wait")


@dataclasses.dataclass(frozen=True, slots=True)
class SaveReport:
    """What a rank tells every other before it stages a save (one all-gather)."""

    rank: int
    slot: SlotState
    reuse: bool  # its layout is the last planned save's
    byte_results: tuple[WriteResult, ...]  # when reusing: where its non-tensor values go
    plan: SavePlan | None = None  # rank 0's decision: full or delta, against what
    plan_error: Exception | None = None  # why rank 0 could not decide


class Staging(enum.Enum):
    REUSE = "reuse"  # every rank copies in its last layout; the coordinator patches metadata
    REPLAN = "replan"  # a full DCP save
    SKIP = "skip"  # a rank's slot is busy: nobody saves


def decide(reports: Sequence[SaveReport], *, wait_timeout_s: float) -> tuple[Staging, SavePlan]:
    """What every rank does with this save; the same answer on every rank, or an error."""
    first = reports[0]
    if first.plan_error is not None:
        raise first.plan_error
    timed_out = [r.rank for r in reports if r.slot is SlotState.TIMED_OUT]
    if timed_out:
        raise CheckpointError(
            f"rank(s) {timed_out}: no staging slot freed up within {wait_timeout_s:.0f}s "
            "(is the sidecar running? see its log)"
        )
    assert first.plan is not None
    if any(r.slot is SlotState.BUSY for r in reports):
        return Staging.SKIP, first.plan
    if all(r.reuse for r in reports):
        return Staging.REUSE, first.plan
    return Staging.REPLAN, first.plan
