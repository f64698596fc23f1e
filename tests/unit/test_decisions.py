"""The operator's decisions, table-driven: no cluster, no clock."""

from __future__ import annotations

import pytest
from ctj_operator.decisions import (
    Decision,
    JobState,
    NodeView,
    PodView,
    attempt_failure,
    backoff,
    decide,
)
from ctj_operator.spec import JobSpec, SpecError

TEMPLATE = {"spec": {"containers": [{"name": "trainer", "image": "x"}]}}


def spec(**kw: object) -> JobSpec:
    base: dict[str, object] = dict(
        replicas=3,
        min_replicas=1,
        max_replicas=4,
        nproc_per_node=1,
        backend="pods",
        template=TEMPLATE,
        checkpoint=JobSpec.parse(
            {"checkpoint": {"uri": "s3://b/p"}, "template": TEMPLATE}
        ).checkpoint,
        max_restarts=2,
        backoff_seconds=2.0,
        stabilization_seconds=30.0,
    )
    base.update(kw)
    return JobSpec(**base)  # type: ignore[arg-type]


def nodes(ready: int, not_ready: int = 0, cordoned: int = 0) -> list[NodeView]:
    out = [NodeView(f"n{i}", True, True) for i in range(ready)]
    out += [NodeView(f"bad{i}", False, True) for i in range(not_ready)]
    out += [NodeView(f"cord{i}", True, False) for i in range(cordoned)]
    return out


def pods(n: int, phase: str = "Running", **kw: object) -> list[PodView]:
    return [PodView(f"p{i}", i, phase, f"n{i}", **kw) for i in range(n)]  # type: ignore[arg-type]


RUNNING3 = JobState(phase="Running", attempt=1, world_size=3, pods_created=True)


@pytest.mark.parametrize(
    ("state", "the_pods", "the_nodes", "now", "want"),
    [
        # a new job starts at min(replicas, usable nodes)
        (JobState(), [], nodes(5), 0.0, ("start", 3, "Started")),
        (JobState(), [], nodes(2), 0.0, ("start", 2, "Started")),
        # not enough usable nodes: wait, saying why
        (JobState(), [], nodes(0, not_ready=3), 0.0, ("wait", 0, "InsufficientNodes")),
        # the operator died while creating the attempt's pods: finish creating them
        (
            JobState(phase="Running", attempt=1, world_size=3),
            [],
            nodes(3),
            0.0,
            ("create_pods", 3, ""),
        ),
        # healthy
        (RUNNING3, pods(3), nodes(3), 0.0, ("none", 0, "")),
        # a node of the gang goes NotReady: restart, counted as a failure
        (
            RUNNING3,
            pods(2) + [PodView("p2", 2, "Running", "bad0")],
            nodes(2, not_ready=1),
            0.0,
            ("restart", 0, "NodeNotReady"),
        ),
        (
            RUNNING3,
            pods(2) + [PodView("p2", 2, "Running", "gone")],
            nodes(2),
            0.0,
            ("restart", 0, "NodeDeleted"),
        ),
        (
            RUNNING3,
            pods(2) + [PodView("p2", 2, "Running", "cord0")],
            nodes(2, cordoned=1),
            0.0,
            ("restart", 0, "NodeCordoned"),
        ),
        (RUNNING3, pods(2), nodes(3), 0.0, ("restart", 0, "PodDeleted")),
        (
            RUNNING3,
            pods(2) + [PodView("p2", 2, "Failed", "n2", reason="Evicted")],
            nodes(3),
            0.0,
            ("restart", 0, "PodEvicted"),
        ),
        (
            RUNNING3,
            pods(2) + [PodView("p2", 2, "Failed", "n2")],
            nodes(3),
            0.0,
            ("restart", 0, "PodFailed"),
        ),
        # too many failures: fail with the reason
        (
            JobState(phase="Running", attempt=3, world_size=3, pods_created=True, restarts=2),
            pods(2) + [PodView("p2", 2, "Failed", "n2")],
            nodes(3),
            0.0,
            ("fail", 0, "MaxRestartsExceeded"),
        ),
        # every rank exited 0
        (RUNNING3, pods(3, "Succeeded"), nodes(3), 0.0, ("succeed", 0, "Completed")),
        # restarting: back off, then start at what the nodes allow
        (
            JobState(phase="Restarting", attempt=1, world_size=3, not_before=10.0),
            [],
            nodes(2),
            5.0,
            ("wait", 0, ""),
        ),
        (
            JobState(phase="Restarting", attempt=1, world_size=3, not_before=10.0),
            [],
            nodes(2),
            10.0,
            ("start", 2, "Started"),
        ),
        # the ended attempt's pods still on live nodes hold the new gang back
        (
            JobState(phase="Restarting", attempt=1, world_size=3),
            pods(2),
            nodes(3),
            0.0,
            ("wait", 0, "TearingDown"),
        ),
        # ... but one stuck on a NotReady node does not, and that node is not counted
        (
            JobState(phase="Restarting", attempt=1, world_size=3),
            [PodView("p2", 2, "Running", "bad0")],
            nodes(2, not_ready=1),
            0.0,
            ("start", 2, "Started"),
        ),
        # capacity came back: wait out the stabilization window, then grow
        (
            JobState(phase="Running", attempt=2, world_size=2, pods_created=True),
            pods(2),
            nodes(3),
            100.0,
            ("wait", 0, ""),
        ),
        (
            JobState(
                phase="Running", attempt=2, world_size=2, pods_created=True, capacity_since=60.0
            ),
            pods(2),
            nodes(3),
            100.0,
            ("restart", 0, "ScaleUp"),
        ),
    ],
)
def test_decide(
    state: JobState,
    the_pods: list[PodView],
    the_nodes: list[NodeView],
    now: float,
    want: tuple[str, int, str],
) -> None:
    d = decide(spec(), state, the_pods, the_nodes, now)
    assert (d.action, d.world_size, d.reason) == want


def test_failures_count_but_resizes_do_not() -> None:
    failed = decide(spec(), RUNNING3, pods(2), nodes(3), 0.0)
    assert failed.counts_as_failure
    resized = decide(spec(replicas=2), RUNNING3, pods(3), nodes(3), 0.0)
    assert (resized.action, resized.reason, resized.counts_as_failure) == (
        "restart",
        "Resize",
        False,
    )


def test_stabilization_window_starts_when_capacity_is_first_seen() -> None:
    state = JobState(phase="Running", attempt=2, world_size=2, pods_created=True)
    first = decide(spec(), state, pods(2), nodes(3), 100.0)
    assert first == Decision("wait", capacity_since=100.0, requeue_after=30.0)
    gone = decide(
        spec(),
        JobState(phase="Running", attempt=2, world_size=2, pods_created=True, capacity_since=90.0),
        pods(2),
        nodes(2),
        100.0,
    )
    assert gone.action == "none" and gone.capacity_since is None  # the window resets


def test_scale_up_can_be_disabled() -> None:
    state = JobState(
        phase="Running", attempt=2, world_size=2, pods_created=True, capacity_since=0.0
    )
    assert decide(spec(scale_up=False), state, pods(2), nodes(3), 100.0).action == "none"


def test_terminal_phases_are_final() -> None:
    for phase in ("Succeeded", "Failed"):
        assert decide(spec(), JobState(phase=phase, attempt=1), [], nodes(3), 0.0).action == "none"


def test_backoff_doubles_and_caps() -> None:
    s = spec(backoff_seconds=2.0)
    assert [backoff(s, n) for n in (0, 1, 2, 3)] == [2.0, 4.0, 8.0, 16.0]
    assert backoff(s, 30) == 300.0


def test_attempt_failure_ignores_finished_pods_on_lost_nodes() -> None:
    done = [PodView("p0", 0, "Succeeded", "bad0")]
    assert attempt_failure(done, nodes(0, not_ready=1), 1) is None


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"replicas": 5, "maxReplicas": 4}, "spec.replicas=5 must be within"),
        ({"template": {"spec": {"containers": []}}}, "spec.template.spec.containers is empty"),
        ({"checkpoint": {}}, "spec.checkpoint.uri is missing"),
    ],
)
def test_spec_errors_name_the_field(raw: dict[str, object], message: str) -> None:
    body: dict[str, object] = {"checkpoint": {"uri": "s3://b/p"}, "template": TEMPLATE}
    body.update(raw)
    with pytest.raises(SpecError, match=message):
        JobSpec.parse(body)
