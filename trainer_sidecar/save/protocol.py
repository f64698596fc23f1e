"""The save protocol, top to bottom: slot, one exchange, the one copy, metadata.

``SaveProtocol.stage`` is the whole of a save up to the staged slot; the
Checkpointer only calls it and hands the slot to the persister.

Reusing a save's layout: DCP plans a save once, later saves skip its collectives.

DCP's save gathers every rank's plan on the coordinator, deduplicates and merges
them, scatters the result, copies, gathers the write results and writes the
metadata: several collectives and a good deal of Python on every save, all of it
decided by the state's layout alone (names, shapes, dtypes, shards). While no
rank's layout changes, those decisions do not either, so a save copies straight
into its slot in the last save's item order and reuses its metadata, updating
only where the non-tensor values (whose byte sizes change) now lie.

Whether every rank still matches is decided together, from the one exchange a
save makes anyway (``SaveReport``): one rank's change makes every rank replan.
The same exchange carries rank 0's plan, the save's identity included, so
every rank stages under the same identity.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import pickle
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from .. import collectives
from ..config import BusyPolicy, CheckpointConfig
from ..errors import CheckpointError
from ..format.manifest import METADATA_FILE, SaveIdentity
from ..format.policy import Committed, SavePlan, plan_save
from ..metrics import CheckpointMetrics
from ..store import repository
from ..store.base import ObjectStore
from . import slots, staging
from .staging import StagingWriter

log = logging.getLogger("ctj.checkpoint")


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


@dataclasses.dataclass(frozen=True, slots=True)
class StagedSave:
    """A save copied into its slot, described, not yet handed to the persister."""

    slot: Path
    staged: slots.StagedCheckpoint
    replanned: bool  # DCP planned it (first save, or a rank's layout changed)


class SaveProtocol:
    """Owns what a save reuses from the last one: the layout, the coordinator's metadata."""

    def __init__(
        self,
        *,
        config: CheckpointConfig,
        store: ObjectStore,
        root: Path,
        rank: int,
        group: Any,
        metrics: CheckpointMetrics,
    ) -> None:
        self.config = config
        self.store = store
        self.root = root
        self.rank = rank
        self.group = group
        self.metrics = metrics
        self._layout: Layout | None = None  # the last planned save's, reused
        self._metadata_blob: tuple[tuple[Any, ...], bytes] | None = None  # (values' places, pickle)

    def stage(self, step: int, state: dict[str, Any], *, started: float) -> StagedSave | None:
        """Collective: copy ``state`` into this rank's slot; None if the save is skipped.

        One all-gather (rank 0's plan, every rank's slot and layout), and, only when
        some rank's layout changed (the first save, new optimizer state), DCP's own
        planning round.
        """
        planner, items = local_plan(state, is_coordinator=self.rank == 0)
        slot, slot_state = self._acquire_slot()
        report, blobs = self._report(step, slot, slot_state, planner, items)
        copied = None
        if report.reuse and slot is not None:
            # copy before the exchange: the usual case, wasted only if another rank replans
            copied = self._copy_in_layout(slot, planner, blobs)
            if copied is None:
                report = dataclasses.replace(report, reuse=False, byte_results=())
        reports = collectives.gather_all(report, self.group)
        how, plan = decide(reports, wait_timeout_s=self.config.slot_wait_timeout_s)
        if how is Staging.SKIP:
            self.metrics.count_skipped()
            log.warning("skipped the save of step %d: the previous one is still uploading", step)
            return None
        assert slot is not None
        try:
            if how is Staging.REUSE and copied is not None:
                files = copied
                self._write_reused_metadata(slot, reports)
            else:
                files = self._replan(slot, state)
        except (Exception, CheckpointException) as exc:
            self._layout = None
            self.metrics.count_failure("stage")
            raise CheckpointError(f"staging step {step} failed: {exc}") from exc
        if self.rank == 0:
            files.append((METADATA_FILE, ()))
        staged = slots.StagedCheckpoint(
            step=step,
            rank=self.rank,
            world_size=len(reports),
            plan=plan,
            files=tuple(files),
            staged_at=time.time(),
            stage_seconds=time.monotonic() - started,
        )
        return StagedSave(slot, staged, replanned=how is Staging.REPLAN)

    def _latest(self, step: int) -> Committed | None:
        """The latest commit before ``step``: from the persister's state file, else the store."""
        known = slots.read_state(self.root, self.config.uri)
        if known is not None and known.step < step:
            return known
        latest = repository.latest_manifest(self.store, before=step)
        return Committed.of(latest) if latest else None

    def _acquire_slot(self) -> tuple[Path | None, SlotState]:
        """This rank's free slot (waiting for one under busy_policy "wait"); no collectives."""
        count = self.config.staging_slots
        if self.config.busy_policy is BusyPolicy.SKIP:
            slot = slots.free_slot(self.root, self.rank, count)
            return slot, SlotState.FREE if slot else SlotState.BUSY
        slot = slots.wait_free_slot(self.root, self.rank, count, self.config.slot_wait_timeout_s)
        return slot, SlotState.FREE if slot else SlotState.TIMED_OUT

    def _report(
        self,
        step: int,
        slot: Path | None,
        slot_state: SlotState,
        planner: Any,
        items: tuple[Any, ...],
    ) -> tuple[SaveReport, list[memoryview]]:
        """This rank's part of the one exchange before staging, and its serialized values."""
        layout = self._layout
        reuse = slot is not None and layout is not None and layout.matches(items)
        blobs: list[memoryview] = []
        placed: list[Any] = []
        if reuse and layout is not None:
            try:
                blobs = staging.serialize_bytes(layout.byte_items, planner)
                placed = staging.byte_results(self.rank, layout.byte_items, blobs)
            except Exception as exc:  # noqa: BLE001 - DCP's replan reports it on every rank
                log.warning(
                    "rank %d: serializing the non-tensor values failed (%s)", self.rank, exc
                )
                reuse = False
        plan, error = None, None
        if self.rank == 0:
            try:
                plan = plan_save(
                    step,
                    mode=self.config.mode,
                    full_every=self.config.full_every,
                    latest=self._latest(step),
                    save=SaveIdentity.new(self.config.attempt),
                )
            except Exception as exc:  # noqa: BLE001 - raised on every rank by decide()
                error = exc
        report = SaveReport(self.rank, slot_state, reuse, tuple(placed), plan, error)
        return report, blobs

    def _copy_in_layout(
        self, slot: Path, planner: Any, blobs: list[memoryview]
    ) -> staging.StagedFiles | None:
        """The one copy into the slot, in the last planned layout (None if it failed:
        this rank then asks for a replan, and DCP reports the failure on every rank)."""
        layout = self._layout
        assert layout is not None
        try:
            _, files = staging.stage_items(
                slot, self.rank, layout.tensor_items, layout.byte_items, planner, blobs
            )
            return files
        except Exception as exc:  # noqa: BLE001 - never leave the other ranks in the exchange
            log.warning(
                "rank %d: copying into the staging slot failed (%s): replanning", self.rank, exc
            )
            return None

    def _write_reused_metadata(self, slot: Path, reports: list[SaveReport]) -> None:
        """The coordinator's .metadata: the planned one, with the values where they lie now."""
        layout = self._layout
        if layout is None or layout.metadata is None:  # not the coordinator
            return
        placed = tuple(r for report in reports for r in report.byte_results)
        if self._metadata_blob is None or self._metadata_blob[0] != placed:
            merged = merged_metadata(layout.metadata, placed)
            self._metadata_blob = (placed, pickle.dumps(merged))
        staging.write_metadata(slot, self._metadata_blob[1])

    def _replan(self, slot: Path, state: dict[str, Any]) -> staging.StagedFiles:
        """A DCP save through the staging writer: it plans, copies, and leaves its layout."""
        writer = StagingWriter(slot)
        self._layout, self._metadata_blob = None, None
        dcp.save(
            state, storage_writer=writer, planner=DefaultSavePlanner(), process_group=self.group
        )
        self._layout = Layout.of(writer)
        return list(writer.files)
