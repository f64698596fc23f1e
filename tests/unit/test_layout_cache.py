"""The one collective decision of a save: skip, reuse the last layout, or replan."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from trainer_sidecar.errors import CheckpointError
from trainer_sidecar.format.manifest import SaveIdentity
from trainer_sidecar.format.policy import plan_save
from trainer_sidecar.save.protocol import (
    SaveReport,
    SlotState,
    Staging,
    decide,
    local_plan,
    merged_metadata,
)

SAVE = SaveIdentity("0", "0123456789abcdef")
PLAN = plan_save(7, mode="incremental", full_every=10, latest=None, save=SAVE)
FREE, BUSY, TIMED_OUT = SlotState.FREE, SlotState.BUSY, SlotState.TIMED_OUT


def reports(*ranks: tuple[SlotState, bool]) -> list[SaveReport]:
    return [
        SaveReport(r, slot, reuse, (), PLAN if r == 0 else None)
        for r, (slot, reuse) in enumerate(ranks)
    ]


@pytest.mark.parametrize(
    ("ranks", "want"),
    [
        ([(FREE, True), (FREE, True)], Staging.REUSE),
        ([(FREE, True), (FREE, False)], Staging.REPLAN),  # one rank's change: all replan
        ([(FREE, False), (FREE, True)], Staging.REPLAN),
        ([(FREE, True), (BUSY, False)], Staging.SKIP),  # one busy slot: nobody saves
        ([(BUSY, True), (FREE, True)], Staging.SKIP),
        ([(FREE, True)], Staging.REUSE),
    ],
)
def test_every_rank_gets_the_same_answer(
    ranks: list[tuple[SlotState, bool]], want: Staging
) -> None:
    how, plan = decide(reports(*ranks), wait_timeout_s=5)
    assert (how, plan) == (want, PLAN)


def test_a_timed_out_slot_fails_every_rank_naming_it() -> None:
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1\].*within 5s.*sidecar"):
        decide(reports((FREE, True), (TIMED_OUT, False)), wait_timeout_s=5)


def test_rank0s_planning_error_is_raised_everywhere() -> None:
    failed = SaveReport(0, FREE, True, (), None, CheckpointError("store down"))
    with pytest.raises(CheckpointError, match="store down"):
        decide([failed, SaveReport(1, FREE, True, ())], wait_timeout_s=5)


def test_merged_metadata_moves_only_the_values_that_were_restaged() -> None:
    weight, step = MetadataIndex("model.w", torch.Size([0])), MetadataIndex("extra.step")
    old = Metadata({}, storage_data={weight: ("__0_0.distcp", 0, 64), step: ("__0_1.distcp", 0, 9)})
    new = merged_metadata(old, [WriteResult(step, 12, ("__0_1.distcp", 0, 12))])
    assert new.storage_data == {weight: ("__0_0.distcp", 0, 64), step: ("__0_1.distcp", 0, 12)}
    assert old.storage_data[step] == ("__0_1.distcp", 0, 9)  # the cached one is left alone


def test_the_local_plan_is_the_layout_key() -> None:
    state = {"model": {"w": torch.zeros(4, 4)}, "extra": {"step": 1}}
    _, items = local_plan(state, is_coordinator=True)
    _, same = local_plan(
        {"model": {"w": torch.ones(4, 4)}, "extra": {"step": 99}}, is_coordinator=True
    )
    _, wider = local_plan(
        {"model": {"w": torch.zeros(4, 5)}, "extra": {"step": 1}}, is_coordinator=True
    )
    assert items == same  # values do not matter, not even the non-tensor ones
    assert items != wider
