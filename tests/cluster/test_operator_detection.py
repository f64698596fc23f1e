"""Failure detection's rules, on the local cluster with the operator's default timings
(heartbeat period 1 s, timeout 3 s): an API server paused past the timeout costs nothing,
not even the attempt, and liveness costs the API server nothing (its audit log counts
every request in a steady window).

A trainer stopped (SIGSTOP) for less than the timeout, and one stopped for good (ended as
``RankHung`` within the timeout, restarted at the same size, counted as the job's
failure) run on kind (tests/e2e/test_job_lifecycle.py, ``Lifecycle.pauses_a_rank`` and
``hangs_a_rank``), on real kubelets and containers: not repeated here."""

from __future__ import annotations

import datetime as dt
import functools
import os
import signal
import time
from collections.abc import Iterator

import pytest
from ctj_devcluster import Binaries, Cluster
from ctj_devcluster.audit import count, read_events
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    OperatorProcess,
    running,
    status,
    trainer_events,
    wait_for,
)

from tests.cluster.operator_env import crd_cluster

pytestmark = pytest.mark.cluster

TIMEOUT_S = 3.0  # failureDetection.heartbeatTimeoutSeconds, examples/job.yaml's default
WRITES = frozenset({"create", "update", "patch", "delete", "deletecollection"})


@pytest.fixture(scope="module")
def op_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """operator_env's three nodes, with the API server's audit log on."""
    root = tmp_path_factory.mktemp("detection")
    with crd_cluster(root, cluster_binaries, node_monitor_grace_period=8.0, audit_log=True) as c:
        yield c


def steps_of(cluster: Cluster, namespace: str, pod: str) -> list[int]:
    return [e["step"] for e in trainer_events(cluster, namespace, pod) if e.get("event") == "step"]


def training(cluster: Cluster, namespace: str, name: str) -> int:
    """Attempt 1 runs at 3 and has trained a step (so every trainer has its pulse: its
    Checkpointer was made before the collective load, and steps are collective): the last
    step rank 0 logged (only rank 0 logs)."""
    wait_for(lambda: running(cluster, namespace, name, 1, 3), "attempt 1 running on 3 nodes", 180)
    pod = f"{name}-a1-0"
    steps = wait_for(functools.partial(steps_of, cluster, namespace, pod), f"{pod} to train", 120)
    return int(steps[-1])


def test_an_api_server_paused_past_the_timeout_restarts_nothing(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    """An API server hiccup (SIGSTOP to kube-apiserver for longer than the heartbeat
    timeout, shorter than the node-monitor grace and the leader Lease's renew deadline) is
    not a failure: liveness does not go through it, so training goes on in the same
    attempt and the operator carries on once it is back."""
    ns, name = job_namespace, "hiccup"
    new_job(name, env=FAST_TRAINING)
    before = training(op_cluster, ns, name)
    (apiserver,) = [p for p in op_cluster.control_plane.processes if p.name == "kube-apiserver"]
    os.kill(apiserver.pid, signal.SIGSTOP)
    try:
        time.sleep(TIMEOUT_S + 2.0)  # the fault itself: the API server gone for this long
    finally:
        os.kill(apiserver.pid, signal.SIGCONT)
    pod = f"{name}-a1-0"
    wait_for(lambda: steps_of(op_cluster, ns, pod)[-1] >= before + 30, "training past it", 60)
    st = status(op_cluster, ns, name)
    assert (st["attempt"], st.get("restarts", 0), st.get("nodeRestarts", 0)) == (1, 0, 0), st


def test_steady_liveness_costs_the_api_server_no_write(
    op_cluster: Cluster, operator: OperatorProcess, job_namespace: str, new_job: NewJob
) -> None:
    """Three ranks whose trainers only sleep, asked by the operator every second: in a
    window of 30 s the pods send the API server nothing (the target: at most 1 liveness
    write per pod per minute), and the operator writes nothing but its leader Lease."""
    ns, name, pods, window_s = job_namespace, "quiet", 3, 30.0
    new_job(name, command=["sleep", "100000"], replicas=pods, minReplicas=pods,
            maxReplicas=pods)  # fmt: skip
    wait_for(lambda: running(op_cluster, ns, name, 1, pods), "attempt 1 running", 180)
    # the operator's last write of the start: every rank seen running (status.healthySince)
    wait_for(lambda: status(op_cluster, ns, name).get("healthySince"), "every rank running", 30)
    since = dt.datetime.now(dt.UTC)
    deadline = time.monotonic() + window_s

    def window_over() -> bool:  # the operator must ask throughout: it stays up
        assert operator.proc.poll() is None, "the operator exited"
        return time.monotonic() >= deadline

    wait_for(window_over, "the window's end", window_s + 10)
    until = dt.datetime.now(dt.UTC)
    st = status(op_cluster, ns, name)
    assert (st["attempt"], st.get("restarts", 0)) == (1, 0), "not a steady state"

    events = read_events(op_cluster.audit_log_path)
    leader = [e for e in events if e.resource == "leases" and e.name == operator.lease]
    assert leader, "the operator's leader Lease is not in the audit log"
    operator_user = leader[0].user
    sidecars = count(events, user=f"system:serviceaccount:{ns}:default", since=since, until=until)
    assert not sidecars, f"the pods sent the API server {dict(sidecars)}"
    # this job's namespace and cluster-scoped objects: the operator may still be posting
    # an Event of an earlier test's job into that test's terminating namespace (kopf
    # retries such posts for a while), which is not this steady job's cost
    writes = [
        e
        for e in events
        if e.user == operator_user and e.verb in WRITES and e.name != operator.lease
        and e.namespace in (ns, "")
        and e.request_received is not None and since <= e.request_received < until
        and e.stage == "ResponseComplete"
    ]  # fmt: skip
    limit = pods * window_s / 60  # 1 per pod per minute
    seen = [(e.verb, e.request_uri, e.user_agent, str(e.request_received)) for e in writes]
    print(f"the operator's writes besides its Lease in {window_s:g} s: {seen or 'none'}")
    assert len(writes) <= limit, seen
