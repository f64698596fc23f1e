"""A warm spare takes a lost rank, on the local cluster: the job keeps its world size (no
resharding: the restore reads what the same number of ranks saved), the survivors and the
spare keep their pods (the launcher restarts their workers in place), and a new spare is
made for the next loss (docs/operator.md, "Warm spares")."""

from __future__ import annotations

import time

import pytest
from ctj_contract import LABEL_RANK, LABEL_SPARE
from ctj_devcluster import Cluster
from ctj_stack.jobs import FAST_TRAINING, NewJob, job_pods, rank0_events, running, status, wait_for

pytestmark = pytest.mark.cluster


def spares(cluster: Cluster, ns: str, name: str) -> list[object]:
    return [
        p
        for p in job_pods(cluster, ns, name)
        if (p.metadata.labels or {}).get(LABEL_SPARE) == "true"
        and p.status.phase == "Running"
        and not p.metadata.deletion_timestamp
    ]


def test_a_spare_takes_a_lost_rank_at_the_same_world_size(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "spare"
    new_job(name, env=FAST_TRAINING, replicas=2, minReplicas=1, spares=1)
    wait_for(lambda: running(op_cluster, ns, name, 1, 2), "attempt 1 running on 2 nodes", 180)
    (warm,) = wait_for(lambda: spares(op_cluster, ns, name), "a warm spare running", 120)
    wait_for(lambda: status(op_cluster, ns, name).get("spares") == 1, "status.spares: 1", 30)
    wait_for(
        lambda: [e for e in rank0_events(op_cluster, ns, name, 1) if e["event"] == "committed"],
        "a commit of attempt 1",
        120,
    )
    pods = {p.metadata.name: p for p in job_pods(op_cluster, ns, name)}
    victim = pods[f"{name}-a1-1"]
    killed = time.time()
    op_cluster.kill_node(victim.spec.node_name)

    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 running on 2", 120)
    assert st["carried"] == [f"{name}-a1-0", warm.metadata.name], st
    now = {p.metadata.name: p for p in job_pods(op_cluster, ns, name)}
    taken = now[warm.metadata.name]
    assert taken.metadata.uid == warm.metadata.uid, "the spare's own pod holds the rank"
    assert taken.metadata.labels[LABEL_RANK] == "1" and LABEL_SPARE not in taken.metadata.labels
    assert now[f"{name}-a1-0"].metadata.uid == pods[f"{name}-a1-0"].metadata.uid

    def restored() -> dict[str, object] | None:
        found = [e for e in rank0_events(op_cluster, ns, name, 2) if e["event"] == "restored"]
        return found[0] if found else None

    event = wait_for(restored, "attempt 2 to restore", 120)
    assert event["world_size"] == event["saved_world_size"] == 2, "no resharding"
    print(f"spare: kill -> restored in {float(event['t']) - killed:.1f} s")
    # a new spare for the next loss (on the one node left free: none here, so it waits)
    made = wait_for(
        lambda: [
            p
            for p in job_pods(op_cluster, ns, name)
            if (p.metadata.labels or {}).get(LABEL_SPARE) == "true"
        ],
        "a new spare asked for",
        60,
    )
    assert made[0].metadata.name != warm.metadata.name
