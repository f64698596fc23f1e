"""spec.suspend, decided (no cluster, no clock): a running attempt checkpoints at a step
boundary and stops, every pod goes (spares and survivors too), the job waits Suspended
with no pod and no deadline running, and false again starts the next attempt at the size
that fits then. Not a restart: nothing counted, no backoff, no Restarted condition."""

from __future__ import annotations

import dataclasses

from ctj_contract import Condition, Phase
from ctj_operator.decisions import (
    CreateAttempt,
    DeleteAttempt,
    DeletePods,
    JobState,
    PatchStatus,
    Plan,
    RequestCheckpoint,
    Restarted,
    Transition,
    job_state,
)
from ctj_operator.heartbeats import JobAsk

from tests.unit.test_decisions import RUNNING3, condition, decide, nodes, observe, pods, spec

SUSPEND = spec(suspend=True)


def _applied(state: JobState, plan: Plan) -> JobState:
    """The state after ``plan``'s status writes, as the next reconcile reads it."""
    raw = {
        "phase": state.phase,
        "attempt": state.attempt,
        "worldSize": state.world_size,
        "podsCreated": state.pods_created,
        "conditions": list(state.conditions),
        **({"startTime": "1970-01-01T00:00:00Z"} if state.start_time is not None else {}),
    }
    for a in plan.actions:
        if isinstance(a, PatchStatus):
            raw.update(a.fields)
    return job_state({k: v for k, v in raw.items() if v is not None})


def _true(state: JobState) -> set[str]:
    return {str(c["type"]) for c in state.conditions if c.get("status") == "True"}


def test_a_running_job_checkpoints_then_its_pods_go_and_it_waits_suspended() -> None:
    asked = decide(observe(RUNNING3, pods(3), nodes(3), 5.0, job=SUSPEND))
    request = next(a for a in asked.actions if isinstance(a, RequestCheckpoint))
    assert (request.attempt, request.world_size) == (1, 3)
    t = asked.status()["transition"]
    assert t["reason"] == "Suspended"
    waiting = dataclasses.replace(
        RUNNING3, transition=Transition(t["reason"], t["message"], 5.0, t["requestId"])
    )
    # every rank saved at the request and exited 0: the attempt ends, counted nowhere
    done = decide(observe(waiting, pods(3, "Succeeded"), nodes(3), 9.0, job=SUSPEND))
    assert not any(isinstance(a, Restarted) for a in done.actions), "a suspend is no restart"
    assert any(isinstance(a, DeleteAttempt) for a in done.actions)
    status = done.status()
    assert (status["restarts"], status["nodeRestarts"], status["notBefore"]) == (0, 0, None)
    assert not any(c["type"] == "Restarted" for c in status["conditions"])
    assert "checkpointed and stopped" in condition(status, "Restarting")["message"]

    # torn down: phase Suspended, the Suspended condition, no deadline running
    torn = _applied(waiting, done)
    plan = decide(observe(torn, [], nodes(3), 12.0, job=SUSPEND))
    assert not any(isinstance(a, CreateAttempt) for a in plan.actions)
    suspended = _applied(torn, plan)
    assert suspended.phase == Phase.SUSPENDED and suspended.start_time is None
    assert {Condition.SUSPENDED} <= _true(suspended)
    said = next(c for c in suspended.conditions if c["type"] == "Suspended")["message"]
    assert said == "attempt 1: spec.suspend is true; checkpointed and stopped", said
    assert Condition.RUNNING not in _true(suspended)
    # and it stays so, writing nothing, for as long as spec.suspend holds
    again = decide(observe(suspended, [], nodes(3), 100.0, job=SUSPEND))
    assert not again.actions


def test_resumed_it_starts_the_next_attempt_at_the_size_that_fits_now() -> None:
    suspended = JobState(phase="Suspended", attempt=1, world_size=3, conditions=())
    plan = decide(observe(suspended, [], nodes(2), 50.0))  # spec.suspend false, 2 nodes
    created = next(a for a in plan.actions if isinstance(a, CreateAttempt))
    assert (created.attempt, created.world_size) == (2, 2)
    started = _applied(suspended, plan)
    assert started.phase == Phase.RUNNING and started.start_time is not None
    assert Condition.SUSPENDED not in _true(started)


def test_a_job_made_suspended_starts_no_attempt_until_resumed() -> None:
    plan = decide(observe(JobState(), [], nodes(3), 1.0, job=SUSPEND))
    assert not any(isinstance(a, CreateAttempt) for a in plan.actions)
    status = plan.status()
    assert status["phase"] == "Suspended" and not status.get("startTime")
    assert condition(status, "Suspended")["status"] == "True"
    resumed = decide(observe(_applied(JobState(), plan), [], nodes(3), 2.0))
    assert next(a for a in resumed.actions if isinstance(a, CreateAttempt)).attempt == 1


def test_a_job_never_suspended_has_no_suspended_condition() -> None:
    plan = decide(observe(JobState(), [], nodes(3), 1.0))
    assert not any(c["type"] == "Suspended" for c in plan.status()["conditions"])


def test_suspended_between_attempts_keeps_no_survivor_and_no_spare() -> None:
    """A node lost while the suspend was pending: the ranks that survived are not kept for
    an attempt that will not start, and the warm spares go."""
    restarting = JobState(
        phase="Restarting", attempt=1, world_size=3, torn_down=True, survivors=("a1-0", "a1-1")
    )
    kept = pods(2, relaunchable=True)
    spare = dataclasses.replace(
        pods(1, attempt=0)[0], name="spare-0", spare=True, relaunchable=True
    )
    plan = decide(observe(restarting, [*kept, spare], nodes(3), 5.0, job=SUSPEND))
    deleted = {n for a in plan.actions if isinstance(a, DeletePods) for n in a.names}
    assert {"a1-0", "a1-1"} <= deleted
    # once they are gone: Suspended, and the spare deleted
    gone = decide(observe(restarting, [spare], nodes(3), 9.0, job=SUSPEND))
    assert "spare-0" in {n for a in gone.actions if isinstance(a, DeletePods) for n in a.names}
    assert gone.status()["phase"] == "Suspended"
    first_write = next(i for i, a in enumerate(gone.actions) if isinstance(a, PatchStatus))
    first_delete = next(i for i, a in enumerate(gone.actions) if isinstance(a, DeletePods))
    assert first_write < first_delete, "a stale view deletes nothing"


def test_the_ranks_are_told_their_attempt_ended_while_suspended() -> None:
    state = JobState(phase="Suspended", attempt=1, world_size=3)
    assert JobAsk.of("u", state, 1.0).ended
