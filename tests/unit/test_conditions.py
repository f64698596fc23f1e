"""A job's standard conditions (conditions.py) and what every plan records of the job as
read (decisions.observed): metav1.Condition semantics, observedGeneration, the scale
selector, startTime. Pure: no cluster, no clock."""

from __future__ import annotations

import dataclasses
from typing import Any

from ctj_contract import Phase, parse_time
from ctj_operator.conditions import enter_phase, set_condition, stamped, written
from ctj_operator.decisions import JobState, Observation, PatchStatus, Plan, invalid_spec, job_state

from tests.unit.test_decisions import RUNNING3, decide, nodes, observe, pod, pods

T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z
PHASES = ("Queued", "Running", "Restarting", "Succeeded", "Failed")


def by_type(conditions: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in conditions}


def statuses(conditions: list[dict[str, Any]]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in conditions}


def at(state: JobState, plan: Plan) -> JobState:
    """The state after ``plan``'s status writes (a merge patch, as the API server does)."""
    status: dict[str, Any] = {
        "phase": state.phase,
        "attempt": state.attempt,
        "worldSize": state.world_size,
        "conditions": list(state.conditions),
        "observedGeneration": state.observed_generation,
        "selector": state.selector,
        "podsCreated": state.pods_created,
        "tornDown": state.torn_down,
    }
    if state.start_time is not None:
        status["startTime"] = "2027-01-15T08:00:00Z"
    status.update(plan.status())
    return job_state({k: v for k, v in status.items() if v is not None})


def seen(state: JobState, now: float, generation: int = 1, **kw: Any) -> Observation:
    return dataclasses.replace(
        observe(state, kw.pop("the_pods", []), kw.pop("the_nodes", nodes(3)), now, **kw),
        generation=generation,
        selector="training.ctj.dev/job-name=job",
    )


# ---- the rules, on their own ----


def test_entering_a_phase_sets_its_condition_true_and_the_others_false() -> None:
    found = enter_phase([], Phase.RUNNING, "Started", "attempt 1", now=T0, generation=3)
    assert statuses(found) == {
        "Queued": "False",
        "Running": "True",
        "Restarting": "False",
        "Succeeded": "False",
        "Failed": "False",
    }
    assert [c["type"] for c in found] == list(PHASES)  # one order, whatever the history
    for c in found:
        assert c["reason"] == "Started" and c["message"] == "attempt 1"
        assert c["lastTransitionTime"] == "2027-01-15T08:00:00Z"
        assert c["observedGeneration"] == 3


def test_last_transition_time_changes_only_when_the_status_changes() -> None:
    running = enter_phase([], Phase.RUNNING, "Started", "attempt 1", now=T0, generation=1)
    restarting = enter_phase(
        running, Phase.RESTARTING, "HeartbeatLost", "rank 2 silent", now=T0 + 60, generation=1
    )
    after = by_type(restarting)
    assert after["Running"]["status"] == "False"
    assert after["Running"]["lastTransitionTime"] == "2027-01-15T08:01:00Z"
    assert after["Running"]["reason"] == "HeartbeatLost"  # why it turned False
    assert after["Restarting"]["lastTransitionTime"] == "2027-01-15T08:01:00Z"
    # False and still False: untouched, it says why it last turned False
    assert after["Succeeded"] == {**by_type(running)["Succeeded"], "observedGeneration": 1}
    # True and still True: the reason and message follow, the time does not
    again = set_condition(
        restarting, "Restarting", True, "PodFailed", "pod x failed", now=T0 + 90, generation=1
    )
    assert by_type(again)["Restarting"]["reason"] == "PodFailed"
    assert by_type(again)["Restarting"]["lastTransitionTime"] == "2027-01-15T08:01:00Z"


def test_every_write_stamps_every_condition_with_the_generation_read() -> None:
    """kubectl wait waits while a condition's observedGeneration is behind the job's
    generation: an edit must not leave one behind."""
    old = enter_phase([], Phase.SUCCEEDED, "Completed", "done", now=T0, generation=1)
    now = stamped(old, 2)
    assert {c["observedGeneration"] for c in now} == {2}
    assert [c["lastTransitionTime"] for c in now] == [c["lastTransitionTime"] for c in old]
    assert stamped(old, 0) == old  # generation unknown: nothing claimed


def test_an_older_operators_conditions_are_taken_over() -> None:
    """Before: one condition whose type was the phase, and Waiting while nodes lacked."""
    legacy = [
        {"type": "Waiting", "status": "True", "reason": "InsufficientNodes", "message": "m"},
        {"type": "Restarted", "status": "True", "reason": "PodFailed", "message": "m"},
    ]
    found = set_condition(legacy, "Queued", True, "InsufficientNodes", "m", now=T0, generation=1)
    assert [c["type"] for c in found] == ["Queued", "Restarted"]


def test_a_job_finished_when_its_succeeded_or_failed_condition_turned_true() -> None:
    running = enter_phase([], Phase.RUNNING, "Started", "m", now=T0, generation=1)
    assert JobState(conditions=running).finished_at is None  # Succeeded and Failed are False
    done = enter_phase(running, Phase.SUCCEEDED, "Completed", "m", now=T0 + 5, generation=1)
    assert JobState(conditions=done).finished_at == T0 + 5
    failed = enter_phase(running, Phase.FAILED, "DeadlineExceeded", "m", now=T0 + 7, generation=1)
    assert JobState(conditions=failed).finished_at == T0 + 7
    assert parse_time("2027-01-15T08:00:00Z") == T0
    assert parse_time("yesterday") is None


# ---- through the decisions ----


def test_a_job_through_its_life_keeps_one_condition_per_phase() -> None:
    queued = decide(seen(JobState(), T0, the_nodes=nodes(0)))
    state = at(JobState(), queued)
    assert state.phase == "Pending"
    assert statuses(list(state.conditions)) == {"Queued": "True"}
    assert by_type(list(state.conditions))["Queued"]["reason"] == "InsufficientNodes"

    started = decide(seen(state, T0 + 10))
    state = at(state, started)
    assert statuses(list(state.conditions)) == {
        "Queued": "False",
        "Running": "True",
        "Restarting": "False",
        "Succeeded": "False",
        "Failed": "False",
    }
    assert by_type(list(state.conditions))["Queued"]["lastTransitionTime"] == (
        "2027-01-15T08:00:10Z"
    )

    ended = decide(seen(state, T0 + 50, the_pods=pods(2)))
    state = at(state, ended)
    conditions = by_type(list(state.conditions))
    assert (state.phase, conditions["Running"]["status"]) == ("Restarting", "False")
    assert conditions["Restarting"]["status"] == "True"
    assert conditions["Restarting"]["reason"] == conditions["Restarted"]["reason"] == "PodDeleted"

    state = dataclasses.replace(state, torn_down=True)
    again = at(state, decide(seen(state, T0 + 60)))
    conditions = by_type(list(again.conditions))
    assert (conditions["Running"]["status"], conditions["Restarting"]["status"]) == (
        "True",
        "False",
    )
    # Restarted stays True from the first restart on; its reason is the last restart's
    assert conditions["Restarted"]["lastTransitionTime"] == "2027-01-15T08:00:50Z"

    running = dataclasses.replace(again, pods_created=True, attempt_started=T0 + 60)
    done = at(running, decide(seen(running, T0 + 90, the_pods=pods(3, "Succeeded", attempt=2))))
    assert statuses(list(done.conditions))["Succeeded"] == "True"
    assert statuses(list(done.conditions))["Running"] == "False"


def test_waiting_for_nodes_is_written_once_while_nothing_changes() -> None:
    first = decide(seen(JobState(), T0, the_nodes=nodes(0)))
    state = at(JobState(), first)
    assert decide(seen(state, T0 + 5, the_nodes=nodes(0))).status() == {}


def test_an_edit_is_recorded_as_the_observed_generation_and_nothing_else_changes() -> None:
    healthy = dataclasses.replace(
        RUNNING3,
        healthy_since=0.0,
        observed_generation=1,
        selector="training.ctj.dev/job-name=job",
        conditions=tuple(enter_phase([], Phase.RUNNING, "Started", "m", now=T0, generation=1)),
    )
    assert decide(seen(healthy, T0 + 5, the_pods=pods(3))).actions == ()  # steady: no request
    edited = decide(seen(healthy, T0 + 5, generation=2, the_pods=pods(3)))
    written = edited.status()
    assert written["observedGeneration"] == 2
    assert {c["observedGeneration"] for c in written["conditions"]} == {2}
    assert [c["lastTransitionTime"] for c in written["conditions"]] == [
        c["lastTransitionTime"] for c in healthy.conditions
    ]
    assert written.keys() == {"observedGeneration", "conditions"}


def test_a_plan_that_writes_conditions_writes_them_at_the_generation_read() -> None:
    plan = decide(seen(RUNNING3, T0, generation=4, the_pods=pods(2) + [pod(2, "Failed")]))
    written = plan.status()
    assert written["observedGeneration"] == 4
    assert {c["observedGeneration"] for c in written["conditions"]} == {4}
    # and it is one write, the plan's first: still conditional on the version read
    assert plan.kinds()[0] == "PatchStatus"


def test_the_scale_selector_and_the_start_time_are_written_once() -> None:
    first = decide(seen(JobState(), T0))
    written = first.status()
    assert written["selector"] == "training.ctj.dev/job-name=job"
    assert written["startTime"] == "2027-01-15T08:00:00Z"
    state = at(JobState(), first)
    assert state.selector == written["selector"] and state.start_time == T0
    later = decide(seen(dataclasses.replace(state, pods_created=True), T0 + 5, the_pods=pods(3)))
    assert "selector" not in later.status() and "startTime" not in later.status()


def test_an_invalid_spec_fails_the_job_with_standard_conditions() -> None:
    plan = invalid_spec(JobState(), "spec.backend='mpi': use pods or pytorchjob or trainjob", 2)
    status = written(plan, (), now=T0, generation=2).status()
    assert status["phase"] == "Failed" and status["observedGeneration"] == 2
    assert by_type(status["conditions"])["Failed"]["reason"] == "InvalidSpec"
    failed = job_state(status)
    assert invalid_spec(failed, "same", 2).actions == ()
    edited = written(invalid_spec(failed, "same", 3), failed.conditions, now=T0 + 1, generation=3)
    assert edited.status()["observedGeneration"] == 3 and "phase" not in edited.status()
    assert {c["observedGeneration"] for c in edited.status()["conditions"]} == {3}


def test_a_rejected_pod_restarts_with_standard_conditions() -> None:
    # the attempt's status is written, then its pods are refused: podsCreated stays False
    started = dataclasses.replace(at(JobState(), decide(seen(JobState(), T0))), pods_created=False)
    plan = decide(seen(started, T0 + 1, refused="exceeded quota"))
    conditions = by_type(plan.status()["conditions"])
    assert conditions["Restarting"]["status"] == conditions["Restarted"]["status"] == "True"
    assert conditions["Running"]["status"] == "False"


def test_an_edit_mid_attempt_is_shown_pending_until_the_next_attempt_runs_it() -> None:
    healthy = dataclasses.replace(
        RUNNING3,
        healthy_since=0.0,
        observed_generation=1,
        attempt_generation=1,
        selector="training.ctj.dev/job-name=job",
        conditions=tuple(enter_phase([], Phase.RUNNING, "Started", "m", now=T0, generation=1)),
    )
    edited = decide(seen(healthy, T0 + 5, generation=2, the_pods=pods(3)))
    pending = by_type(edited.status()["conditions"])["SpecPending"]
    assert (pending["status"], pending["reason"]) == ("True", "AppliesAtNextAttempt")
    assert "attempt 1 runs the spec of generation 1; generation 2 applies" in pending["message"]
    assert pending["observedGeneration"] == 2
    running = by_type(edited.status()["conditions"])["Running"]
    assert (
        running["lastTransitionTime"]
        == by_type(list(healthy.conditions))["Running"]["lastTransitionTime"]
    )

    # the attempt ends (a rank's pod went); the next one starts from generation 2
    state = dataclasses.replace(
        healthy,
        phase="Restarting",
        torn_down=True,
        observed_generation=2,
        conditions=tuple(edited.status()["conditions"]),
    )
    started = decide(seen(state, T0 + 60, generation=2))
    written = started.status()
    assert written["attemptGeneration"] == 2
    applied = by_type(written["conditions"])["SpecPending"]
    assert (applied["status"], applied["reason"]) == ("False", "Applied")
    assert applied["message"] == "attempt 2 runs generation 2"


def test_an_attempt_started_before_attempt_generations_shows_nothing_pending() -> None:
    legacy = dataclasses.replace(RUNNING3, healthy_since=0.0, observed_generation=1)
    written = decide(seen(legacy, T0 + 5, generation=2, the_pods=pods(3))).status()
    assert "SpecPending" not in by_type(written.get("conditions") or [])


def test_an_edit_seen_as_an_attempt_starts_is_not_left_pending() -> None:
    """The edit is noted (SpecPending True) by the plan's first write, and the attempt the
    same plan starts runs it: the last write leaves SpecPending False."""
    restarting = dataclasses.replace(
        RUNNING3,
        phase="Restarting",
        torn_down=True,
        observed_generation=1,
        attempt_generation=1,
        selector="training.ctj.dev/job-name=job",
        conditions=tuple(
            enter_phase([], Phase.RESTARTING, "PodDeleted", "m", now=T0, generation=1)
        ),  # fmt: skip
    )
    # a pod of an older attempt to delete first, so that the note is a write of its own
    plan = decide(seen(restarting, T0 + 60, generation=2, the_pods=pods(1, attempt=0)))
    writes = [a.fields for a in plan.actions if isinstance(a, PatchStatus)]
    assert by_type(writes[0]["conditions"])["SpecPending"]["status"] == "True"
    final = by_type(at(restarting, plan).conditions)
    assert final["Running"]["status"] == "True"
    assert (final["SpecPending"]["status"], final["SpecPending"]["reason"]) == ("False", "Applied")
