"""The operator's decisions, table-driven: no cluster, no clock (docs/operator.md's rules)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ctj_operator import conditions, decisions
from ctj_operator.decisions import (
    Cause,
    CreateAttempt,
    DeleteAttempt,
    DeletePods,
    JobState,
    NodeView,
    Observation,
    PatchStatus,
    Plan,
    PodView,
    RequestCheckpoint,
    Restarted,
    Transition,
    backoff,
    job_state,
)
from ctj_operator.spec import JobSpec, SpecError

TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "x"}]}}


def spec(**kw: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "replicas": 3,
        "minReplicas": 1,
        "maxReplicas": 4,
        "template": TEMPLATE,
        "checkpoint": {"uri": "s3://b/p"},
        "restartPolicy": {"maxRestarts": 2, "backoffSeconds": 2.0, "resetAfterSeconds": 600},
        "scaleUp": {"stabilizationSeconds": 30.0},
    }
    raw.update(kw)
    return JobSpec.parse(raw)


def nodes(ready: int, not_ready: int = 0, cordoned: int = 0) -> list[NodeView]:
    out = [NodeView(f"n{i}", True) for i in range(ready)]
    out += [NodeView(f"bad{i}", False) for i in range(not_ready)]
    out += [NodeView(f"cord{i}", True, cordoned=True) for i in range(cordoned)]
    return out


def pods(n: int, phase: str = "Running", attempt: int = 1, **kw: Any) -> list[PodView]:
    return [PodView(f"a{attempt}-{i}", attempt, i, phase, f"n{i}", **kw) for i in range(n)]


def pod(rank: int, phase: str = "Running", node: str | None = None, **kw: Any) -> PodView:
    return PodView(f"a1-{rank}", kw.pop("attempt", 1), rank, phase, node or f"n{rank}", **kw)


RUNNING3 = JobState(
    phase="Running",
    attempt=1,
    world_size=3,
    pods_created=True,
    attempt_started=-100.0,
    start_time=-100.0,
)


def observe(
    state: JobState,
    the_pods: list[PodView],
    the_nodes: list[NodeView],
    now: float = 0.0,
    *,
    job: JobSpec | None = None,
    fits: list[str] | None = None,
    beats: dict[int, float | None] | None = None,
    trainers: dict[int, float] | None = None,
    unanswered: dict[int, float] | None = None,
    last_checkpoint: dict[str, Any] | None = None,
    controller_failure: str = "",
    refused: str = "",
) -> Observation:
    usable = [n.name for n in the_nodes if n.ready and not n.cordoned]
    return Observation(
        spec=job or spec(),
        state=state,
        pods=the_pods,
        nodes=the_nodes,
        fits=usable if fits is None else fits,
        beats=beats or {},
        trainers=trainers or {},
        unanswered=unanswered or {},
        last_checkpoint=last_checkpoint,
        uri="s3://b/p/ns/job-uid",
        now=now,
        controller_failure=controller_failure,
        refused=refused,
        job="job",
    )


def decide(obs: Observation) -> Plan:
    """The plan a reconcile sends for ``obs``: ``decisions.decide``, its condition changes
    made into the lists each status write carries (conditions.written), as in reconcile.py."""
    plan = decisions.decide(obs)
    return conditions.written(plan, obs.state.conditions, now=obs.now, generation=obs.generation)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    """The condition of type ``kind`` a status write carries."""
    return next(c for c in status["conditions"] if c["type"] == kind)


def what(plan: Plan) -> str:
    """One line a table row can name: start N | create N | restart Reason cause | fail
    Reason | succeed | request Reason | wait."""
    status = plan.status()
    for a in plan.actions:
        if isinstance(a, Restarted):
            return f"restart {a.reason} {a.cause}"
        if isinstance(a, RequestCheckpoint):
            return f"request {status['transition']['reason']}"
    if status.get("phase") == "Failed":
        return f"fail {condition(status, 'Failed')['reason']}"
    if status.get("phase") == "Succeeded":
        return "succeed"
    for a in plan.actions:
        if isinstance(a, CreateAttempt):
            return f"{'start' if 'attempt' in status else 'create'} {a.world_size}"
    return "wait"


@pytest.mark.parametrize(
    ("state", "the_pods", "the_nodes", "now", "want"),
    [
        pytest.param(JobState(), [], nodes(5), 0.0, "start 3", id="new-job-starts-at-replicas"),
        pytest.param(JobState(), [], nodes(2), 0.0, "start 2", id="new-job-starts-at-fit"),
        pytest.param(JobState(), [], nodes(0, not_ready=3), 0.0, "wait", id="no-node-waits"),
        pytest.param(
            dataclasses.replace(RUNNING3, pods_created=False),
            [],
            nodes(3),
            0.0,
            "create 3",
            id="operator-stopped-mid-create-finishes-it",
        ),
        pytest.param(RUNNING3, pods(3), nodes(3), 0.0, "wait", id="healthy"),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, node="bad0")],
            nodes(2, not_ready=1),
            0.0,
            "restart NodeNotReady node",
            id="node-not-ready",
        ),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, node="gone")],
            nodes(2),
            0.0,
            "restart NodeDeleted node",
            id="node-deleted",
        ),
        pytest.param(RUNNING3, pods(2), nodes(3), 0.0, "restart PodDeleted node", id="pod-missing"),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, terminating=True)],
            nodes(3),
            0.0,
            "restart PodDeleted node",
            id="pod-terminating",
        ),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, "Failed", reason="Evicted")],
            nodes(3),
            0.0,
            "restart PodEvicted node",
            id="pod-evicted",
        ),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, "Failed")],
            nodes(3),
            0.0,
            "restart PodFailed crash",
            id="pod-failed-is-a-crash",
        ),
        pytest.param(
            dataclasses.replace(RUNNING3, restarts=2),
            pods(2) + [pod(2, "Failed")],
            nodes(3),
            0.0,
            "fail MaxRestartsExceeded",
            id="crashes-exhaust-max-restarts",
        ),
        pytest.param(
            dataclasses.replace(RUNNING3, restarts=2, node_restarts=50),
            pods(2),
            nodes(3),
            0.0,
            "restart PodDeleted node",
            id="node-restarts-do-not-count",
        ),
        pytest.param(
            dataclasses.replace(RUNNING3, restarts=2, healthy_since=0.0),
            pods(2) + [pod(2, "Failed")],
            nodes(3),
            600.0,
            "restart PodFailed crash",
            id="a-long-healthy-run-forgives-crashes",
        ),
        pytest.param(RUNNING3, pods(3, "Succeeded"), nodes(3), 0.0, "succeed", id="all-exit-0"),
        pytest.param(
            JobState(phase="Restarting", attempt=1, world_size=3, not_before=10.0),
            [],
            nodes(2),
            5.0,
            "wait",
            id="backoff",
        ),
        pytest.param(
            JobState(phase="Restarting", attempt=1, world_size=3, not_before=10.0),
            [],
            nodes(2),
            10.0,
            "start 2",
            id="after-backoff-start-at-fit",
        ),
        pytest.param(
            JobState(phase="Restarting", attempt=1, world_size=3),
            pods(2, terminating=True),
            nodes(3),
            0.0,
            "wait",
            id="terminating-pods-hold-the-new-gang",
        ),
        pytest.param(
            dataclasses.replace(RUNNING3, world_size=2, capacity_since=60.0),
            pods(2),
            nodes(3),
            100.0,
            "request ScaleUp",
            id="capacity-stable-asks-a-checkpoint-then-grows",
        ),
        pytest.param(
            dataclasses.replace(RUNNING3, world_size=2),
            pods(2),
            nodes(3),
            100.0,
            "wait",
            id="capacity-new-waits-the-window",
        ),
        pytest.param(
            RUNNING3,
            pods(2) + [pod(2, node="cord0")],
            nodes(2, cordoned=1),
            0.0,
            "request NodeDrained",
            id="cordon-is-planned",
        ),
    ],
)
def test_decide(
    state: JobState, the_pods: list[PodView], the_nodes: list[NodeView], now: float, want: str
) -> None:
    assert what(decide(observe(state, the_pods, the_nodes, now))) == want


def test_a_resize_checkpoints_first_and_ends_when_the_ranks_stopped() -> None:
    asked = decide(observe(RUNNING3, pods(3), nodes(3), 5.0, job=spec(replicas=2)))
    assert what(asked) == "request Resize"
    request = next(a for a in asked.actions if isinstance(a, RequestCheckpoint))
    assert (request.attempt, request.world_size) == (1, 3)
    t = asked.status()["transition"]
    waiting = dataclasses.replace(
        RUNNING3, transition=Transition(t["reason"], t["message"], 5.0, t["requestId"])
    )
    # still training: wait for the save, and do not ask again
    assert what(decide(observe(waiting, pods(3), nodes(3), 10.0, job=spec(replicas=2)))) == "wait"
    # every rank saved and exited 0: a planned restart, never "Succeeded"
    done = decide(observe(waiting, pods(3, "Succeeded"), nodes(3), 20.0, job=spec(replicas=2)))
    assert what(done) == "restart Resize planned"
    assert done.status()["restarts"] == 0 and done.status()["nodeRestarts"] == 0
    assert done.status()["notBefore"] is None  # no backoff for a planned restart
    # a trainer that ignores the request: restart anyway after the timeout
    late = decide(observe(waiting, pods(3), nodes(3), 126.0, job=spec(replicas=2)))
    assert what(late) == "restart Resize planned"
    restarting = condition(late.status(), "Restarting")
    assert "steps since the last checkpoint are lost" in restarting["message"]


def test_a_failure_during_a_transition_ends_it_as_a_failure() -> None:
    waiting = dataclasses.replace(RUNNING3, transition=Transition("Resize", "m", 5.0, "1-R-5"))
    plan = decide(observe(waiting, pods(2) + [pod(2, "Failed")], nodes(3), 6.0))
    assert what(plan) == "restart PodFailed crash"


def test_heartbeat_lost_ends_the_attempt_in_seconds_and_the_node_is_suspect() -> None:
    beats: dict[int, float | None] = {0: 1.0, 1: 1.0, 2: 10.5}
    plan = decide(observe(RUNNING3, pods(3), nodes(3), 100.0, beats=beats))
    assert what(plan) == "restart HeartbeatLost node"
    status = plan.status()
    assert status["suspectNodes"] == {"n2": 100.0}
    # the silent rank's pod is force-deleted (its kubelet may be gone), the others not
    deletes = [a for a in plan.actions if isinstance(a, DeletePods)]
    assert DeletePods(("a1-2",), force=True) in deletes
    assert DeletePods(("a1-0", "a1-1")) in deletes
    assert any(isinstance(a, DeleteAttempt) for a in plan.actions)


def test_a_trainer_silent_past_the_timeout_behind_a_live_sidecar_is_a_hung_rank() -> None:
    """Its sidecar answers (so no HeartbeatLost), its trainer has not run for longer than
    the timeout: the attempt ends, as the job's own failure (a hang that recurs must stop at
    maxRestarts); its node is not suspect, its pod is deleted by force."""
    beats: dict[int, float | None] = {0: 0.5, 1: 0.5, 2: 0.5}
    plan = decide(observe(RUNNING3, pods(3), nodes(3), 100.0, beats=beats, trainers={1: 3.4}))
    assert what(plan) == "restart RankHung crash"
    message = condition(plan.status(), "Restarted")["message"]
    assert "trainer of rank 1 (pod a1-1) has not run for 3s" in message
    assert "heartbeatTimeoutSeconds=3" in message
    assert not plan.status().get("suspectNodes")
    # a stopped trainer ignores SIGTERM: its pod goes by force, the others as usual
    deletes = [a for a in plan.actions if isinstance(a, DeletePods)]
    assert DeletePods(("a1-1",), force=True) in deletes
    assert DeletePods(("a1-0", "a1-2")) in deletes


@pytest.mark.parametrize(
    ("rank2", "expected"),
    [
        pytest.param(2.5, None, id="a-peer-late-waits"),
        pytest.param(3.5, "restart HeartbeatLost node", id="the-peer-lost-is-the-node"),
        pytest.param(1.5, "restart RankHung crash", id="every-peer-on-time-is-a-hang"),
    ],
)
def test_a_trainer_stalled_while_a_peer_is_late_waits_for_the_peers_verdict(
    rank2: float, expected: str | None
) -> None:
    """When a node dies its peers' trainers stall (their collective waits or breaks), and
    their silence, counted from their last step, can pass the timeout before the lost
    rank's heartbeat does (its last beat may come after their last step): the node loss
    would count as the job's crash. With rank 2 late (2.5 s, over two periods), rank 1's
    stalled trainer decides nothing; rank 2 lost past the timeout is the node's; on time,
    the hang is judged."""
    beats: dict[int, float | None] = {0: 0.5, 1: 0.5, 2: rank2}
    plan = decide(observe(RUNNING3, pods(3), nodes(3), 100.0, beats=beats, trainers={1: 3.4}))
    if expected is None:
        assert not any(isinstance(a, Restarted | DeletePods) for a in plan.actions), plan
    else:
        assert what(plan) == expected


def test_the_recovery_budget_is_kept_when_the_next_attempt_runs() -> None:
    """Every rank of attempt 2 Running: the failure seen at 100 (HeartbeatLost), attempt 2
    started at 103, running at 110 stay in status.lastRecovery, and failureSeenAt goes."""
    restarted = {"type": "Restarted", "status": "True", "reason": "HeartbeatLost"}
    state = dataclasses.replace(
        RUNNING3, attempt=2, attempt_started=103.0, failure_seen_at=100.0,
        conditions=(restarted,),
    )  # fmt: skip
    plan = decide(observe(state, pods(3, attempt=2), nodes(3), 110.0))
    status = plan.status()
    assert status["failureSeenAt"] is None
    assert status["lastRecovery"] == {
        "reason": "HeartbeatLost",
        "failureSeenAt": 100.0,
        "attemptStarted": 103.0,
        "runningAt": 110.0,
        "seconds": 10.0,
    }
    healthy = dataclasses.replace(state, failure_seen_at=None, healthy_since=110.0)
    later = decide(observe(healthy, pods(3, attempt=2), nodes(3), 120.0)).status()
    assert "lastRecovery" not in later, "written once, when the ranks run"


@pytest.mark.parametrize(
    ("trainers", "phase"),
    [
        pytest.param({1: 2.9}, "Running", id="stopped-shorter-than-the-timeout"),
        pytest.param({}, "Running", id="no-pulse-yet"),
        pytest.param({1: 60.0}, "Pending", id="not-running"),
    ],
)
def test_trainer_silences_that_do_not_end_an_attempt(
    trainers: dict[int, float], phase: str
) -> None:
    the_pods = [pod(0), pod(1, phase), pod(2)]
    beats: dict[int, float | None] = {0: 0.5, 1: 0.5, 2: 0.5}
    assert (
        what(decide(observe(RUNNING3, the_pods, nodes(3), 1.0, beats=beats, trainers=trainers)))
        == "wait"
    )


def test_a_rank_not_heard_yet_has_the_startup_grace_not_the_timeout() -> None:
    """Running for 8 s, never answered (its sidecar still starting among 20 on a busy
    node, or this operator just started): not lost yet; past the grace, lost."""
    beats: dict[int, float | None] = {0: 0.5, 1: None, 2: 0.5}
    starting = observe(RUNNING3, pods(3), nodes(3), 10.0, beats=beats, unanswered={1: 8.0})
    assert what(decide(starting)) == "wait"
    late = observe(RUNNING3, pods(3), nodes(3), 10.0, beats=beats, unanswered={1: 10.5})
    plan = decide(late)
    assert what(plan) == "restart HeartbeatLost node"
    assert (
        "has answered no heartbeat in the 10s since it was seen Running"
        in condition(plan.status(), "Restarted")["message"]
    )


def test_a_rank_whose_trainer_ended_is_not_judged_by_its_silence() -> None:
    """A planned stop or the job's end: the trainers exit, the kubelet stops each pod's
    sidecar, whose heartbeat stops seconds before the pod reads Succeeded. Not a loss."""
    ending = [pod(0, finished=True), pod(1, finished=True), pod(2)]
    beats: dict[int, float | None] = {0: 5.0, 1: 5.0, 2: 0.5}
    plan = decide(observe(RUNNING3, ending, nodes(3), 10.0, beats=beats, trainers={0: 9.0}))
    assert what(plan) == "wait"


def test_a_lost_node_is_judged_before_a_hung_trainer() -> None:
    """A node gone silent whose last answer said its trainer was stalled: the node's."""
    beats: dict[int, float | None] = {0: 0.5, 1: 3.5, 2: 0.5}
    plan = decide(observe(RUNNING3, pods(3), nodes(3), 10.0, beats=beats, trainers={1: 3.5}))
    assert what(plan) == "restart HeartbeatLost node"


@pytest.mark.parametrize(
    ("beats", "phase"),
    [
        pytest.param({2: 2.9}, "Running", id="within-timeout"),
        pytest.param({2: None}, "Running", id="never-beat-yet"),
        pytest.param({2: 60.0}, "Pending", id="not-running"),
    ],
)
def test_heartbeats_that_do_not_end_an_attempt(beats: dict[int, float | None], phase: str) -> None:
    the_pods = pods(2) + [pod(2, phase)]
    assert what(decide(observe(RUNNING3, the_pods, nodes(3), 1.0, beats=beats))) == "wait"


def test_a_suspect_node_does_not_count_until_its_kubelet_is_seen_again() -> None:
    state = JobState(phase="Restarting", attempt=1, world_size=3, suspect={"n2": 100.0})
    dead = [*nodes(2), NodeView("n2", True, alive_at=99.0)]
    plan = decide(observe(state, [], dead, 101.0))
    assert what(plan) == "start 2"
    back = [*nodes(2), NodeView("n2", True, alive_at=105.0)]
    plan = decide(observe(state, [], back, 106.0))
    assert what(plan) == "start 3"
    assert plan.status()["suspectNodes"] == {"n2": None}  # a merge patch: null removes it
    start = next(a for a in plan.actions if isinstance(a, CreateAttempt))
    assert start.avoid == ()


def test_the_next_attempt_is_kept_off_a_suspect_node() -> None:
    """It still reads Ready (its grace period runs): the scheduler must not place a rank
    there, so the attempt's pods carry a node affinity excluding it."""
    state = JobState(phase="Restarting", attempt=1, world_size=3, suspect={"n2": 100.0})
    plan = decide(observe(state, [], [*nodes(2), NodeView("n2", True, alive_at=99.0)], 101.0))
    start = next(a for a in plan.actions if isinstance(a, CreateAttempt))
    assert (start.world_size, start.avoid) == (2, ("n2",))
    assert "suspectNodes" not in plan.status()  # unchanged: nothing to write


def test_pending_past_the_timeout_ends_the_attempt_and_caps_the_next() -> None:
    job = spec(failureDetection={"schedulingTimeoutSeconds": 60})
    started = dataclasses.replace(RUNNING3, attempt_started=0.0)
    waiting = pods(2) + [PodView("a1-2", 1, 2, "Pending", None, waiting="0/3 nodes: Insufficient")]
    assert what(decide(observe(started, waiting, nodes(3), 59.0, job=job))) == "wait"
    plan = decide(observe(started, waiting, nodes(3), 61.0, job=job))
    assert what(plan) == "restart Unschedulable node"
    assert plan.status()["sizeCap"] == 2
    assert "0/3 nodes: Insufficient" in condition(plan.status(), "Restarted")["message"]
    after = job_state({**plan.status(), "tornDown": True, "attempt": 1})
    assert what(decide(observe(after, [], nodes(3), 70.0, job=job))) == "start 2"


def test_teardown_force_deletes_after_the_deadline_and_on_dead_nodes() -> None:
    state = JobState(phase="Restarting", attempt=1, world_size=3, teardown_since=0.0)
    lingering = [pod(0, terminating=True), pod(1, terminating=True, node="bad0")]
    early = decide(observe(state, lingering, [*nodes(2), NodeView("bad0", False)], 10.0))
    assert DeletePods(("a1-1",), force=True) in early.actions
    assert not any(isinstance(a, CreateAttempt) for a in early.actions)
    late = decide(observe(state, lingering, [*nodes(2), NodeView("bad0", False)], 46.0))
    assert DeletePods(("a1-0", "a1-1"), force=True) in late.actions


def test_a_stale_view_acts_on_nothing() -> None:
    """A pod of a newer attempt than the job read: the body lags our own writes."""
    newer = pods(3, attempt=2)
    assert decide(observe(RUNNING3, newer, nodes(3))).actions == ()


def test_older_attempts_are_removed_in_any_view() -> None:
    state = dataclasses.replace(RUNNING3, attempt=2)
    plan = decide(observe(state, pods(3, attempt=2) + pods(1, attempt=1), nodes(3)))
    assert plan.actions[0] == DeletePods(("a1-0",))


def test_every_mutating_plan_starts_with_a_status_write() -> None:
    """The handler sends the first write with the resourceVersion read, so a plan made
    from a stale view fails before it creates or deletes anything of the current attempt."""
    cases = [
        observe(JobState(), [], nodes(3)),
        observe(dataclasses.replace(RUNNING3, pods_created=False), [], nodes(3)),
        observe(RUNNING3, pods(2), nodes(3)),
        observe(RUNNING3, pods(3), nodes(3), job=spec(replicas=2)),
    ]
    for obs in cases:
        acts = [
            a for a in decide(obs).actions if not isinstance(a, DeletePods) or a.names[0][1] != "0"
        ]
        mutating = [
            i
            for i, a in enumerate(acts)
            if isinstance(a, CreateAttempt | DeleteAttempt | RequestCheckpoint)
        ]
        first_write = next(i for i, a in enumerate(acts) if isinstance(a, PatchStatus))
        assert mutating and first_write < mutating[0], obs


def test_a_rejected_pod_fails_the_attempt_with_the_apis_reason() -> None:
    """The API refused an object as the attempt was created (reconcile.py notes it): the
    next reconcile ends the attempt with the reason, counted and backed off like a crash,
    the objects created before the refused one removed; never a silent retry."""
    created = dataclasses.replace(RUNNING3, pods_created=False, attempt_started=0.0)
    assert what(decide(observe(created, [], nodes(3)))) == "create 3"  # not refused: again
    why = 'pods "x" is forbidden: exceeded quota'
    plan = decide(observe(created, pods(1), nodes(3), refused=why))
    assert what(plan) == f"restart PodRejected {Cause.CRASH}"
    assert "exceeded quota" in condition(plan.status(), "Restarted")["message"]
    assert plan.status()["restarts"] == 1 and plan.status()["notBefore"] == 2.0
    assert DeletePods(("a1-0",)) in plan.actions
    exhausted = dataclasses.replace(created, restarts=2, attempt=3)
    assert what(decide(observe(exhausted, [], nodes(3), refused="no"))) == (
        "fail MaxRestartsExceeded"
    )


def test_the_last_checkpoint_reaches_status_from_the_job() -> None:
    ckpt = {"step": 40, "time": "2026-12-01T00:00:00Z", "bytes": 10}
    plan = decide(observe(RUNNING3, pods(3), nodes(3), last_checkpoint=ckpt))
    assert plan.status()["lastCheckpoint"] == ckpt
    same = dataclasses.replace(RUNNING3, last_checkpoint=ckpt, healthy_since=0.0)
    assert decide(observe(same, pods(3), nodes(3), last_checkpoint=ckpt)).actions == ()


def test_the_first_start_pins_the_checkpoint_location() -> None:
    assert decide(observe(JobState(), [], nodes(3))).status()["storage"] == {
        "uri": "s3://b/p/ns/job-uid"
    }
    pinned = JobState(phase="Restarting", attempt=1, world_size=3, storage="s3://old")
    assert "storage" not in decide(observe(pinned, [], nodes(3))).status()


def test_capacity_is_what_fits_not_what_is_ready() -> None:
    plan = decide(observe(JobState(), [], nodes(5), fits=["n1", "n3"]))
    assert what(plan) == "start 2"
    none = decide(observe(JobState(), [], nodes(5), fits=[]))
    assert condition(none.status(), "Queued")["reason"] == "InsufficientNodes"


def test_backoff_doubles_and_caps() -> None:
    s = spec()
    assert [backoff(s, n) for n in range(3)] == [2.0, 4.0, 8.0]
    assert backoff(s, 50) == 300.0


def test_job_state_round_trips_what_decide_writes() -> None:
    plan = decide(observe(JobState(), [], nodes(3), 7.0))
    state = job_state(plan.status())
    assert (state.phase, state.attempt, state.world_size, state.attempt_started) == (
        "Running",
        1,
        3,
        7.0,
    )
    assert state.pods_created  # the last write of the start plan


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"replicas": 5, "maxReplicas": 4}, "spec.replicas=5"),
        ({"template": {"spec": {"containers": []}}}, "spec.template.spec.containers"),
        ({"backend": "mpi"}, "spec.backend='mpi'"),
        ({"checkpoint": {}}, "spec.checkpoint.uri"),
        (
            {"failureDetection": {"heartbeatPeriodSeconds": 5, "heartbeatTimeoutSeconds": 10}},
            "heartbeatTimeoutSeconds=10",
        ),
    ],
)
def test_spec_errors_name_the_field(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace(".", r"\.")):
        spec(**raw)


def test_survivors_crashing_because_a_node_died_is_the_nodes_fault() -> None:
    """Kill a node: its rank still reads Running (silent), the others fail at once."""
    the_pods = [pod(0, "Failed", phase_age=1.0), pod(1, "Failed", phase_age=1.0), pod(2)]
    beats: dict[int, float | None] = {0: 1.5, 1: 1.5, 2: 2.0}
    assert what(decide(observe(RUNNING3, the_pods, nodes(3), 3.0, beats=beats))) == "wait"
    late = [pod(0, "Failed", phase_age=3.5), pod(1, "Failed", phase_age=3.5), pod(2)]
    beats = {0: 4.0, 1: 4.0, 2: 4.5}
    plan = decide(observe(RUNNING3, late, nodes(3), 10.5, beats=beats))
    assert what(plan) == "restart HeartbeatLost node"
    assert plan.status()["suspectNodes"] == {"n2": 10.5}


def test_the_lost_ranks_silence_counts_from_its_last_beat_not_from_the_crash() -> None:
    """The survivors noticed late (their collective timed out 2.5 s after the node went):
    the lost rank is judged by its own silence, past the timeout already, at once."""
    the_pods = [pod(0, "Failed", phase_age=0.5), pod(1, "Failed", phase_age=0.5), pod(2)]
    beats: dict[int, float | None] = {0: 0.6, 1: 0.6, 2: 3.2}
    plan = decide(observe(RUNNING3, the_pods, nodes(3), 10.0, beats=beats))
    assert what(plan) == "restart HeartbeatLost node"


@pytest.mark.parametrize(
    "gone",
    [
        pod(1, terminating=True),  # deleted: still Running and beating for its grace period
        pod(1, "Failed", terminating=True),
        pod(1, "Failed", reason="Evicted"),
        pod(1, node="bad0"),
    ],
)
def test_a_lower_rank_crashing_because_a_peer_was_deleted_is_not_the_jobs(
    gone: PodView,
) -> None:
    """Rank 0 is read first, and it failed because rank 1 left: the cluster's doing."""
    the_pods = [pod(0, "Failed", phase_age=1.0), gone, pod(2)]
    beats: dict[int, float | None] = {0: 1.5, 1: 0.5, 2: 0.5}
    plan = decide(observe(RUNNING3, the_pods, nodes(3, not_ready=1), 1.0, beats=beats))
    assert what(plan).endswith(" node"), what(plan)
    assert (plan.status()["restarts"], plan.status()["nodeRestarts"]) == (0, 1)


def test_a_crash_with_every_running_peer_beating_is_the_jobs() -> None:
    the_pods = [pod(0, "Failed", phase_age=3.0), pod(1), pod(2)]
    beats: dict[int, float | None] = {1: 0.5, 2: 1.0}
    plan = decide(observe(RUNNING3, the_pods, nodes(3), 3.0, beats=beats))
    assert what(plan) == "restart PodFailed crash"


def test_a_failed_job_deletes_what_still_runs_of_its_last_attempt() -> None:
    """E.g. rank 0 created before the API rejected rank 1, at maxRestarts."""
    failed = dataclasses.replace(RUNNING3, phase="Failed")
    plan = decide(observe(failed, [pod(0), pod(1, "Failed")], nodes(3)))
    assert plan.actions == (DeletePods(("a1-0",)),)
    done = dataclasses.replace(RUNNING3, phase="Succeeded")
    assert decide(observe(done, pods(3, "Succeeded"), nodes(3))).actions == ()


def test_a_pod_not_yet_seen_right_after_the_start_is_not_gone() -> None:
    """The watch may lag the operator's own creates: a missing rank is judged only
    UNSEEN_GRACE_S after the attempt started."""
    fresh = dataclasses.replace(RUNNING3, attempt_started=0.0)
    assert what(decide(observe(fresh, pods(2), nodes(3), 10.0))) == "wait"
    assert what(decide(observe(fresh, pods(2), nodes(3), 31.0))) == "restart PodDeleted node"


def test_the_kubeflow_controllers_failure_is_read_after_the_pods() -> None:
    """Backend pytorchjob: a PyTorchJob failed by its controller ends the attempt as a
    crash when the pods show nothing else; when they do, they decide: a peer silent
    since the failure (a lost node?) is waited for, and a lost node is the node's fault."""
    failed = "PyTorchJob demo-a1 failed: 1 Worker replica(s) failed"
    plan = decide(observe(RUNNING3, pods(3), nodes(3), controller_failure=failed))
    assert what(plan) == "restart PyTorchJobFailed crash"
    assert condition(plan.status(), "Restarted")["message"].startswith(failed)
    survivors = [pod(0, "Failed", phase_age=1.0), pod(1, "Failed", phase_age=1.0), pod(2)]
    beats: dict[int, float | None] = {0: 1.5, 1: 1.5, 2: 2.0}
    waiting = observe(RUNNING3, survivors, nodes(3), 3.0, beats=beats, controller_failure=failed)
    assert what(decide(waiting)) == "wait"
    on_lost_node = [pod(0), pod(1, node="bad0"), pod(2)]
    lost = observe(RUNNING3, on_lost_node, nodes(3, not_ready=1), controller_failure=failed)
    assert what(decide(lost)) == "restart NodeNotReady node"


def test_a_failed_pod_quotes_how_its_trainer_ended() -> None:
    failed = pod(
        2, "Failed", exit="trainer exited 1: ResumeSourceError: spec.checkpoint.resumeFrom"
    )
    plan = decide(observe(RUNNING3, pods(2) + [failed], nodes(3), 6.0))
    assert what(plan) == "restart PodFailed crash"
    message = condition(plan.status(), "Restarted")["message"]
    assert message == (
        "pod a1-2 failed (trainer exited 1: ResumeSourceError: spec.checkpoint.resumeFrom)"
    ), message
