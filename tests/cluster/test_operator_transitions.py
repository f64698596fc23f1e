"""Planned transitions lose no step; an unplanned one loses at most a checkpoint interval.

Counted from the trainer's own JSON events (examples/train_fsdp.py, rank 0 of each
attempt, pod ``<job>-a<N>-0``): steps lost = the last ``step`` the previous attempt
trained - the step the next attempt ``restored``. A planned transition (a resize, a
drain) asks every rank to checkpoint at its next step boundary and stop, so the next
attempt restores exactly that step, trains step + 1 first, and its GlobalSampler
position (the ``samples`` field) continues where the previous attempt's stood: no
sample skipped, none repeated. A lost node gives no warning: the next attempt restores
the last committed checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ctj_devcluster import Cluster

from tests.cluster.operator_env import (
    FAST_TRAINING,
    NewJob,
    attempt_of,
    committed_steps,
    core,
    job_events,
    job_pods,
    running,
    status,
    trainer_events,
    wait_for,
)

pytestmark = pytest.mark.cluster

Events = list[dict[str, Any]]


def _of(events: Events, kind: str) -> Events:
    return [e for e in events if e.get("event") == kind]


def _restored_and_training(
    cluster: Cluster, namespace: str, pod: str, min_steps: int = 3
) -> tuple[dict[str, Any], Events]:
    """The next attempt's ``restored`` event and its first ``min_steps`` steps or more."""

    def seen() -> Any:
        events = trainer_events(cluster, namespace, pod)
        restored, steps = _of(events, "restored"), _of(events, "step")
        return restored and len(steps) >= min_steps and (restored[0], steps)

    restored: dict[str, Any]
    steps: Events
    restored, steps = wait_for(seen, f"{pod} to restore and train {min_steps} steps", 180)
    return restored, steps


def _steady(cluster: Cluster, ns: str, name: str) -> tuple[str, list[int]]:
    """Attempt 1 runs at 3 and has committed a checkpoint: its master pod, the commits."""
    master = f"{name}-a1-0"
    try:
        wait_for(lambda: running(cluster, ns, name, 1, 3), "attempt 1 running on 3 nodes", 180)
        committed: list[int] = wait_for(
            lambda: committed_steps(cluster, ns, master), "a commit", 180
        )
    except AssertionError as exc:  # say why: the job's conditions and Events
        st = status(cluster, ns, name)
        events = [(e.reason, e.message) for e in job_events(cluster, ns, name)]
        raise AssertionError(f"{exc}\nstatus: {st}\nevents: {events}") from exc
    return master, committed


def _node_of_rank(cluster: Cluster, ns: str, name: str, attempt: int, rank: int) -> str:
    pod = next(
        p for p in job_pods(cluster, ns, name) if p.metadata.name == f"{name}-a{attempt}-{rank}"
    )
    node: str = pod.spec.node_name
    assert node, f"{pod.metadata.name} has no node"
    return node


def _assert_planned_handover(
    cluster: Cluster, ns: str, name: str, world: int
) -> tuple[dict[str, Any], Events]:
    """Attempt 1 stopped at a step boundary it saved; attempt 2 (at ``world``) restored
    exactly that step, trains the next one first, and its samples continue exactly."""
    prev = trainer_events(cluster, ns, f"{name}-a1-0")
    prev_steps = _of(prev, "step")
    assert len(prev_steps) >= 2, prev_steps
    last = prev_steps[-1]
    stopping, stopped = _of(prev, "stopping"), _of(prev, "stopped")
    assert stopping and stopping[0]["step"] == last["step"], (stopping, last)
    assert stopped and stopped[0]["step"] == last["step"], (stopped, last)
    assert last["step"] in {e["step"] for e in _of(prev, "committed")}, "saved and committed"
    assert not _of(prev, "error"), _of(prev, "error")

    restored, steps = _restored_and_training(cluster, ns, f"{name}-a2-0")
    lost = last["step"] - restored["step"]
    assert lost == 0, f"{lost} steps lost: attempt 1 trained {last['step']}, restored {restored}"
    assert restored["world_size"] == world
    assert steps[0]["step"] == restored["step"] + 1, (restored, steps[0])
    assert all(s["world_size"] == world for s in steps)
    first = steps[0]["step"]
    assert [s["step"] for s in steps] == list(range(first, first + len(steps))), "no gap"

    # the GlobalSampler: the position after the restore is attempt 1's at that step
    batch = prev_steps[-1]["samples"] - prev_steps[-2]["samples"]
    assert batch > 0
    for s in steps:
        expected = last["samples"] + (s["step"] - last["step"]) * batch
        assert s["samples"] == expected, f"step {s['step']}: samples {s['samples']} != {expected}"
    return restored, steps


def _restarted(st: dict[str, Any]) -> dict[str, Any]:
    cond: dict[str, Any] = {c["type"]: c for c in st["conditions"]}["Restarted"]
    return cond


def test_resize_3_to_2_loses_no_step(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "resize"
    new_job(name, env=FAST_TRAINING)
    _steady(op_cluster, ns, name)

    op_cluster.kubectl("scale", f"ctj/{name}", "--replicas=2", "-n", ns)
    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 180)
    assert _restarted(st)["reason"] == "Resize", _restarted(st)
    assert (st["restarts"], st["nodeRestarts"]) == (0, 0), "a resize is counted nowhere"
    _assert_planned_handover(op_cluster, ns, name, 2)


@pytest.fixture
def cordoned(op_cluster: Cluster) -> Iterator[list[str]]:
    """Nodes the test cordons, uncordoned afterwards (the next tests want 3)."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        core(op_cluster).patch_node(node, {"spec": {"unschedulable": False}})


def test_drain_of_a_node_loses_no_step(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob, cordoned: list[str]
) -> None:
    ns, name = job_namespace, "drain"
    new_job(name, env=FAST_TRAINING)
    _steady(op_cluster, ns, name)

    node = _node_of_rank(op_cluster, ns, name, 1, 1)
    cordoned.append(node)
    core(op_cluster).patch_node(node, {"spec": {"unschedulable": True}})
    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 180)
    assert _restarted(st)["reason"] == "NodeDrained", _restarted(st)
    assert node in _restarted(st)["message"], _restarted(st)
    assert (st["restarts"], st["nodeRestarts"]) == (0, 0), "a drain is counted nowhere"
    new_nodes = {p.spec.node_name for p in job_pods(op_cluster, ns, name) if attempt_of(p) == 2}
    assert node not in new_nodes, "no rank of attempt 2 on the cordoned node"
    _assert_planned_handover(op_cluster, ns, name, 2)


@pytest.fixture
def killed(op_cluster: Cluster) -> Iterator[list[str]]:
    """Nodes the test kills, restarted afterwards (the next tests want 3)."""
    nodes: list[str] = []
    yield nodes
    for node in nodes:
        op_cluster.restart_node(node)


def test_node_loss_loses_at_most_a_checkpoint_interval(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob, killed: list[str]
) -> None:
    """For comparison, unplanned: no request, so the steps since the last commit are lost."""
    ns, name = job_namespace, "lost"
    job = new_job(name, env=FAST_TRAINING, restartPolicy={"maxRestarts": 5, "backoffSeconds": 1})
    interval = job["spec"]["checkpoint"]["intervalSteps"]
    master, committed = _steady(op_cluster, ns, name)
    # kill just after a fresh commit, so no save is half-way when the node goes
    wait_for(
        lambda: committed_steps(op_cluster, ns, master)[-1] > committed[-1], "a fresh commit", 60
    )
    node = _node_of_rank(op_cluster, ns, name, 1, 1)
    killed.append(node)
    op_cluster.kill_node(node)

    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 180)
    assert _restarted(st)["reason"] in ("HeartbeatLost", "NodeNotReady"), _restarted(st)
    assert (st["restarts"], st["nodeRestarts"]) == (0, 1), "a lost node is not the job's crash"

    restored, steps = _restored_and_training(op_cluster, ns, f"{name}-a2-0")
    prev = trainer_events(op_cluster, ns, master)
    last = _of(prev, "step")[-1]
    commits = {e["step"] for e in _of(prev, "committed")}
    staged = {e["step"] for e in _of(prev, "staged")}
    lost = last["step"] - restored["step"]
    print(f"node loss: attempt 1 trained {last['step']}, attempt 2 restored {restored['step']}")
    # the last checkpoint attempt 1 committed (rank 0 may not have logged its commit yet)
    assert restored["step"] in staged and restored["step"] >= max(commits), (restored, commits)
    assert 0 <= lost <= interval, f"{lost} steps lost (interval {interval})"
    assert restored["world_size"] == 2
    assert steps[0]["step"] == restored["step"] + 1
    batch = _of(prev, "step")[-1]["samples"] - _of(prev, "step")[-2]["samples"]
    at_restore = next(e for e in _of(prev, "step") if e["step"] == restored["step"])
    assert steps[0]["samples"] == at_restore["samples"] + batch, "replays from the checkpoint"
