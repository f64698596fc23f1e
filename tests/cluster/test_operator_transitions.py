"""Planned transitions lose no step; an unplanned one loses at most a checkpoint interval.

Counted from the trainer's own JSON events (examples/train_fsdp.py, rank 0 of each
attempt, pod ``<job>-a<N>-0``): steps lost = the last ``step`` the previous attempt
trained - the step the next attempt ``restored``. A planned transition (a resize, a
drain) asks every rank to checkpoint at its next step boundary and stop, so the next
attempt restores exactly that step, trains step + 1 first, and its GlobalSampler
position (the ``samples`` field) continues where the previous attempt's stood: no
sample skipped, none repeated. A lost node gives no warning: the next attempt restores
the last committed checkpoint. With the upstream node-monitor grace (40 s) a lost node
still reads Ready when the next attempt starts: it must be suspect (every time it is
lost), and no rank may be bound there.
"""

from __future__ import annotations

import datetime as dt
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ctj_devcluster import Binaries, Cluster
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    OperatorProcess,
    attempt_of,
    committed_steps,
    core,
    create_job,
    job_events,
    job_manifest,
    job_pods,
    print_pod_logs,
    rank0_events,
    rank_pod,
    running,
    status,
    trainer_events,
    wait_for,
)

from tests.cluster.operator_env import crd_cluster

pytestmark = pytest.mark.cluster

Events = list[dict[str, Any]]


def _of(events: Events, kind: str) -> Events:
    return [e for e in events if e.get("event") == kind]


def _restored_and_training(
    cluster: Cluster, namespace: str, name: str, attempt: int, min_steps: int = 3
) -> tuple[dict[str, Any], Events]:
    """``attempt``'s ``restored`` event and its first ``min_steps`` steps or more (its rank
    0's pod may be one kept from the attempt before: its events are told by attempt)."""
    pod = f"attempt {attempt}'s rank 0"

    def seen() -> Any:
        events = rank0_events(cluster, namespace, name, attempt)
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
    pod = rank_pod(cluster, ns, name, attempt, rank)
    assert pod is not None, f"no pod holds rank {rank} of attempt {attempt}"
    node: str = pod.spec.node_name
    assert node, f"{pod.metadata.name} has no node"
    return node


def assert_planned_handover(
    cluster: Cluster, ns: str, name: str, world: int, before: int = 1
) -> tuple[dict[str, Any], Events]:
    """Attempt ``before`` stopped at a step boundary it saved; the next (at ``world``)
    restored exactly that step, trains the next one first, and its samples continue
    exactly. (test_operator_lifecycle.py checks its scale-up and its resize with it.)"""
    prev = rank0_events(cluster, ns, name, before)
    prev_steps = _of(prev, "step")
    assert len(prev_steps) >= 2, prev_steps
    last = prev_steps[-1]
    stopping, stopped = _of(prev, "stopping"), _of(prev, "stopped")
    assert stopping and stopping[0]["step"] == last["step"], (stopping, last)
    assert stopped and stopped[0]["step"] == last["step"], (stopped, last)
    assert last["step"] in {e["step"] for e in _of(prev, "committed")}, "saved and committed"
    assert not _of(prev, "error"), _of(prev, "error")

    restored, steps = _restored_and_training(cluster, ns, name, before + 1)
    lost = last["step"] - restored["step"]
    assert lost == 0, f"{lost} steps lost: attempt {before} trained {last['step']}, {restored}"
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


@dataclass
class GraceEnv:
    """A namespace with the S3 credentials, the operator up, on the 40 s-grace cluster;
    nodes a test kills are restarted afterwards."""

    cluster: Cluster
    namespace: str
    s3_uri: str
    endpoint: str
    killed: list[str] = field(default_factory=list)

    def new_job(self, name: str, **manifest: Any) -> dict[str, Any]:
        job = job_manifest(name, self.s3_uri, self.endpoint, env=FAST_TRAINING, **manifest)
        return create_job(self.cluster, self.namespace, job)

    def kill(self, node: str) -> float:
        self.killed.append(node)
        self.cluster.kill_node(node)
        return time.monotonic()


@pytest.fixture(scope="class")
def grace_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """3 nodes, node-monitor grace 40 s and period 5 s (the upstream timings), for one
    test class: stopped before op_cluster starts (file order)."""
    root = tmp_path_factory.mktemp("gracecluster")
    config = {"node_monitor_grace_period": 40.0, "node_monitor_period": 5.0}
    with crd_cluster(root, cluster_binaries, **config) as c:
        yield c


class TestUpstreamNodeGrace:
    """The controller manager keeps the upstream timings (node-monitor grace 40 s, period
    5 s): a lost node still reads Ready for ~40 s, long after its ranks' heartbeats went
    silent (10 s), so the operator alone knows not to trust it (a *suspect* node). One
    cluster for the class, first in the file: stopped before op_cluster starts."""

    @pytest.fixture
    def env(
        self, grace_cluster: Cluster, tmp_path: Path, s3_env: dict[str, str], s3_uri: str
    ) -> Iterator[GraceEnv]:
        c, api = grace_cluster, core(grace_cluster)
        ns = f"grace-{uuid.uuid4().hex[:6]}"
        api.create_namespace({"metadata": {"name": ns}})
        wait_for(lambda: api.list_namespaced_service_account(ns).items, "default SA", 30)
        keys = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        api.create_namespaced_secret(
            ns,
            {"metadata": {"name": "s3-credentials"}, "stringData": {k: s3_env[k] for k in keys}},
        )
        operator = OperatorProcess(c, tmp_path / "operator.log")
        operator.start()
        env = GraceEnv(c, ns, s3_uri, s3_env["AWS_ENDPOINT_URL"])
        try:
            yield env
        finally:
            operator.kill()
            print("---- operator log (tail) ----\n" + operator.log.read_text()[-6000:])
            print_pod_logs(c, ns)
            for node in env.killed:  # first: pods bound to a dead node would never go
                c.restart_node(node)
            api.delete_namespace(ns)
            wait_for(lambda: not api.list_namespaced_pod(ns).items, f"pods of {ns} gone", 90)

    def test_no_rank_of_the_next_attempt_is_bound_to_the_lost_node(self, env: GraceEnv) -> None:
        """Counting the suspect node out is not enough: kube-scheduler sees it Ready and may
        bind a rank there; that attempt never runs and ends ~40 s after the kill
        (NodeNotReady), one more restart. Deterministic here: other pods take half of
        each surviving node, so the scheduler's scores (LeastAllocated,
        BalancedAllocation) prefer the empty, lost one."""
        c, ns, name = env.cluster, env.namespace, "placed"
        env.new_job(name)
        _steady(c, ns, name)
        lost = _node_of_rank(c, ns, name, 1, 1)
        others = sorted(set(c.nodes) - {lost})
        for node in others:
            _half_full(c, ns, node)
        wait_for(lambda: _all_running(c, ns, others), "the other pods Running", 60)

        killed = env.kill(lost)
        where = wait_for(lambda: _bound(c, ns, name, 2), "attempt 2's ranks bound to nodes", 120)
        after = time.monotonic() - killed
        assert lost not in where.values(), (
            f"attempt 2 (bound {after:.0f}s after the kill) has a rank on {lost}, the lost "
            f"node, which reads Ready {_ready(c)}: {where}; status {status(c, ns, name)}"
        )
        st = wait_for(lambda: running(c, ns, name, 2, 2), "attempt 2 at world size 2", 90)
        assert _restarted(st)["reason"] == "HeartbeatLost", _restarted(st)

    def test_a_node_lost_again_is_suspect_again(self, env: GraceEnv) -> None:
        """Lost, back (trusted again: the job grows to 3), lost again: the second loss
        must make it suspect again, so the next attempt is sized without it."""
        c, ns, name = env.cluster, env.namespace, "twice"
        env.new_job(name, scaleUp={"stabilizationSeconds": 3})
        _steady(c, ns, name)
        lost = _node_of_rank(c, ns, name, 1, 1)
        # half of the lost node taken: the scheduler binds the next ranks elsewhere (the
        # test above is about where they are bound; this one about how many there are)
        _half_full(c, ns, lost)
        wait_for(lambda: _all_running(c, ns, [lost]), "the other pod Running", 60)
        env.kill(lost)
        st = wait_for(lambda: running(c, ns, name, 2, 2), "attempt 2 at world size 2", 180)
        assert _restarted(st)["reason"] == "HeartbeatLost", _restarted(st)
        assert lost in (st.get("suspectNodes") or {}), st.get("suspectNodes")

        c.restart_node(lost)
        env.killed.remove(lost)
        st = wait_for(lambda: running(c, ns, name, 3, 3), "attempt 3 at world size 3", 180)
        assert _restarted(st)["reason"] == "ScaleUp", _restarted(st)
        suspects_when_grown = st.get("suspectNodes")
        wait_for(lambda: committed_steps(c, ns, f"{name}-a3-0"), "a commit of attempt 3", 180)
        assert lost in {p.spec.node_name for p in job_pods(c, ns, name) if attempt_of(p) == 3}
        killed = env.kill(lost)  # the same node, lost again
        sized = wait_for(
            lambda: (st := status(c, ns, name)).get("attempt") == 4 and st, "attempt 4", 120
        )
        after = time.monotonic() - killed
        assert sized["worldSize"] == 2, (
            f"attempt 4, started {after:.0f}s after {lost} was lost again, is sized "
            f"{sized['worldSize']} (it counts {lost}, which reads Ready {_ready(c)}); "
            f"suspectNodes now {sized.get('suspectNodes')}, when the job had grown back "
            f"{suspects_when_grown} (the mark of the first loss, kept: an empty map in a "
            "merge patch removes no key)"
        )


def _half_full(c: Cluster, ns: str, node: str) -> None:
    """A pod that is not the job's, bound to ``node``, requesting half its cpu."""
    container = {
        "name": "main",
        "image": "ctj-trainer:latest",
        "command": ["sleep", "100000"],
        "resources": {"requests": {"cpu": "2"}},
    }
    core(c).create_namespaced_pod(
        ns,
        {
            "metadata": {"name": f"other-{node}"},
            "spec": {"nodeName": node, "containers": [container]},
        },
    )


def _all_running(c: Cluster, ns: str, nodes: list[str]) -> bool:
    pods = [core(c).read_namespaced_pod(f"other-{n}", ns) for n in nodes]
    return all(p.status.phase == "Running" for p in pods)


def _bound(c: Cluster, ns: str, name: str, attempt: int) -> dict[str, str] | None:
    """Pod -> node of an attempt once the job is at it and every rank is bound."""
    if status(c, ns, name).get("attempt") != attempt:
        return None
    pods = [p for p in job_pods(c, ns, name) if attempt_of(p) == attempt]
    if not pods or not all(p.spec.node_name for p in pods):
        return None
    return {p.metadata.name: p.spec.node_name for p in pods}


def _ready(c: Cluster) -> dict[str, str]:
    return {
        n.metadata.name: next((x.status for x in n.status.conditions if x.type == "Ready"), "?")
        for n in core(c).list_node().items
    }


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
    assert_planned_handover(op_cluster, ns, name, 2)


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

    restored, steps = _restored_and_training(op_cluster, ns, name, 2)
    prev = rank0_events(op_cluster, ns, name, 1)
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


def test_a_node_lost_during_a_save_does_not_hold_up_the_next_attempt(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob, killed: list[str]
) -> None:
    """The node goes while a save is staged but not committed (it never will be: the lost
    rank's shards die with it). The survivors' trainers fail at their next collective and
    exit; they must not first wait for that commit (Checkpointer.close() would wait
    ``shutdown_grace_s``, 25 s; leaving its ``with`` block on an error does not), or the
    teardown, which waits for their pods, and so the whole recovery, take that much
    longer."""
    ns, name = job_namespace, "midsave"
    new_job(name, env=FAST_TRAINING, restartPolicy={"maxRestarts": 5, "backoffSeconds": 1})
    master, _ = _steady(op_cluster, ns, name)
    node = _node_of_rank(op_cluster, ns, name, 1, 1)

    def in_flight() -> int | None:
        events = trainer_events(op_cluster, ns, master)
        staged = [e["step"] for e in _of(events, "staged")]
        done = {e["step"] for e in _of(events, "committed")}
        return staged[-1] if staged and staged[-1] not in done else None

    wait_for(lambda: in_flight() is None, "no save in flight", 60)
    step = wait_for(in_flight, "a save staged, not yet committed", 60)
    killed.append(node)
    op_cluster.kill_node(node)

    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 180)
    restored, _ = _restored_and_training(op_cluster, ns, name, 2, min_steps=1)
    if restored["step"] >= step:
        pytest.skip(f"step {step} committed before the node went: no save was in flight")
    ended = _iso_to_epoch(_restarted(st)["lastTransitionTime"])
    teardown = float(st["attemptStarted"]) - ended
    waits = [
        line
        for rank in (0, 2)
        for line in op_cluster.container_log(ns, f"{name}-a1-{rank}", "trainer").splitlines()
        if "close()" in line
    ]
    assert teardown < 15, (
        f"attempt 2 was created {teardown:.0f}s after attempt 1 ended (step {step} in flight "
        f"when {node} was lost); the survivors' trainers at exit: {waits}"
    )


def _iso_to_epoch(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
