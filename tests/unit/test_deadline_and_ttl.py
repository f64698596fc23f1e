"""spec.activeDeadlineSeconds and spec.ttlSecondsAfterFinished, as in a Kubernetes Job:
pure decisions, no cluster, no clock."""

from __future__ import annotations

import dataclasses

import pytest
from ctj_contract import Phase
from ctj_operator.conditions import enter_phase
from ctj_operator.decisions import (
    CreateAttempt,
    DeleteAttempt,
    DeleteJob,
    DeletePods,
    Emit,
    JobState,
)
from ctj_operator.spec import SpecError

from tests.unit.test_decisions import RUNNING3, decide, nodes, observe, pod, pods, spec

T0 = 1_800_000_000.0


def test_past_the_deadline_the_job_fails_and_its_pods_are_removed() -> None:
    job = spec(activeDeadlineSeconds=600)
    state = dataclasses.replace(RUNNING3, start_time=T0, healthy_since=T0)
    assert decide(observe(state, pods(3), nodes(3), T0 + 599, job=job)).actions == ()
    plan = decide(
        observe(state, pods(2) + [pod(2, node="bad0")], nodes(2, not_ready=1), T0 + 600, job=job)
    )
    written = plan.status()
    assert written["phase"] == "Failed"
    failed = next(c for c in written["conditions"] if c["type"] == "Failed")
    assert (failed["status"], failed["reason"]) == ("True", "DeadlineExceeded")
    assert "spec.activeDeadlineSeconds=600" in failed["message"]
    assert "checkpoints kept" in failed["message"]
    # the status first (conditional on the version read), then the attempt's objects
    assert plan.kinds()[0] == "PatchStatus"
    assert DeleteAttempt(1) in plan.actions
    assert DeletePods(("a1-0", "a1-1")) in plan.actions
    assert DeletePods(("a1-2",), force=True) in plan.actions  # its node is gone
    assert Emit("Warning", "DeadlineExceeded", failed["message"]) in plan.actions
    # it is not a restart: nothing is started again, and nothing deletes checkpoints
    assert not any(isinstance(a, CreateAttempt) for a in plan.actions)


def test_the_deadline_counts_across_attempts_and_between_them() -> None:
    job = spec(activeDeadlineSeconds=60)
    between = JobState(phase="Restarting", attempt=4, world_size=3, start_time=T0)
    plan = decide(observe(between, [], nodes(3), T0 + 61, job=job))
    assert plan.status()["phase"] == "Failed"
    assert not any(isinstance(a, CreateAttempt) for a in plan.actions)


def test_a_job_never_started_fails_at_its_deadline_with_nothing_to_remove() -> None:
    job = spec(activeDeadlineSeconds=30)
    waiting = JobState(phase="Pending", start_time=T0)
    plan = decide(observe(waiting, [], nodes(0), T0 + 31, job=job))
    assert plan.status()["phase"] == "Failed"
    assert plan.kinds() == ["PatchStatus", "Emit"]


def test_without_a_deadline_a_job_runs_for_ever() -> None:
    state = dataclasses.replace(RUNNING3, start_time=T0, healthy_since=T0)
    assert decide(observe(state, pods(3), nodes(3), T0 + 10**9)).actions == ()


def finished(phase: Phase, at: float) -> JobState:
    running = enter_phase([], Phase.RUNNING, "Started", "m", now=T0, generation=1)
    done = enter_phase(running, phase, "Completed", "m", now=at, generation=1)
    return JobState(phase=phase.value, attempt=1, world_size=3, start_time=T0, conditions=done)


@pytest.mark.parametrize("phase", [Phase.SUCCEEDED, Phase.FAILED])
def test_a_finished_job_is_deleted_once_its_ttl_is_over(phase: Phase) -> None:
    job = spec(ttlSecondsAfterFinished=100)
    state = finished(phase, T0 + 50)
    early = decide(observe(state, [], nodes(3), T0 + 149, job=job))
    assert not any(isinstance(a, DeleteJob) for a in early.actions)
    assert early.requeue_after == 1.0
    assert decide(observe(state, [], nodes(3), T0 + 150, job=job)).actions == (DeleteJob(T0 + 50),)


def test_a_job_past_its_ttl_is_deleted_without_writing_its_status_first() -> None:
    state = finished(Phase.FAILED, T0)
    seen = dataclasses.replace(
        observe(state, [], nodes(3), T0 + 10, job=spec(ttlSecondsAfterFinished=5)), generation=7
    )
    assert decide(seen).actions == (DeleteJob(T0),)


def test_a_ttl_of_zero_deletes_at_once_and_no_ttl_never() -> None:
    state = finished(Phase.SUCCEEDED, T0)
    plan = decide(observe(state, [], nodes(3), T0, job=spec(ttlSecondsAfterFinished=0)))
    assert plan.actions == (DeleteJob(T0),)
    assert decide(observe(state, [], nodes(3), T0 + 10**9)).actions == ()


def test_a_running_job_is_never_deleted_by_its_ttl() -> None:
    state = dataclasses.replace(RUNNING3, healthy_since=0.0)
    plan = decide(observe(state, pods(3), nodes(3), T0, job=spec(ttlSecondsAfterFinished=0)))
    assert not any(isinstance(a, DeleteJob) for a in plan.actions)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds=0"),
        ({"ttlSecondsAfterFinished": -1}, "spec.ttlSecondsAfterFinished=-1"),
    ],
)
def test_the_spec_refuses_a_deadline_or_ttl_that_cannot_work(
    raw: dict[str, int], message: str
) -> None:
    with pytest.raises(SpecError, match=message.replace(".", r"\.")):
        spec(**raw)
