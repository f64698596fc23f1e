"""Losing a node and getting it back: the job shrinks to 2, resumes, and grows back to 3.

One job through the whole sequence (issue 5, tests 2 and 3): a node agent is killed
after a checkpoint committed; the job restarts at world size 2 from that checkpoint,
resharded 3 -> 2; the node returns, and after the stabilization window the job grows
back to 3, again from its last checkpoint.
"""

from __future__ import annotations

from typing import Any

import pytest
from ctj_devcluster import Cluster

from tests.cluster.operator_env import (
    FAST_TRAINING,
    NewJob,
    OperatorProcess,
    attempt_of,
    committed_steps,
    job_events,
    job_pods,
    metric_value,
    running,
    trainer_events,
    wait_for,
)

pytestmark = pytest.mark.cluster


def _resumed(
    cluster: Cluster,
    namespace: str,
    pod: str,
    world: int,
    not_before_step: int,
    *,
    periodic: bool = True,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Waits for the new attempt's master to log `restored` and a few steps after it."""

    def seen() -> Any:
        events = trainer_events(cluster, namespace, pod)
        restored = [e for e in events if e["event"] == "restored"]
        steps = [e for e in events if e["event"] == "step"]
        return restored and len(steps) >= 3 and (restored[0], steps)

    restored, steps = wait_for(seen, f"{pod} to restore and train", timeout=90)
    assert restored["world_size"] == world
    assert restored["step"] >= not_before_step
    if periodic:  # else a planned transition saved the step it stopped at
        assert restored["step"] % 10 == 0
    assert steps[0]["step"] == restored["step"] + 1, "training continues from the checkpoint"
    assert all(s["world_size"] == world for s in steps)
    return restored, steps


def test_node_loss_shrinks_to_two_then_the_node_returns_and_it_grows_to_three(
    op_cluster: Cluster, operator: OperatorProcess, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "elastic"
    new_job(
        name,
        env=FAST_TRAINING,
        scaleUp={"stabilizationSeconds": 3},
        restartPolicy={"maxRestarts": 5, "backoffSeconds": 1},
    )
    wait_for(lambda: running(op_cluster, ns, name, 1, 3), "attempt 1 running on 3 nodes", 90)

    # a checkpoint committed, then the node of a non-master rank is lost
    master = f"{name}-a1-0"
    committed = wait_for(lambda: committed_steps(op_cluster, ns, master), "a commit", 120)
    victim = next(p for p in job_pods(op_cluster, ns, name) if p.metadata.name == f"{name}-a1-1")
    lost_node = victim.spec.node_name
    op_cluster.kill_node(lost_node)

    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 90)
    assert (st["nodeRestarts"], st["restarts"]) == (1, 0), "a lost node is not the job's crash"
    restarted = {c["type"]: c for c in st["conditions"]}["Restarted"]
    assert restarted["reason"] in ("HeartbeatLost", "NodeNotReady"), restarted
    new_pods = [p for p in job_pods(op_cluster, ns, name) if attempt_of(p) == 2]
    assert lost_node not in {p.spec.node_name for p in new_pods}
    # resharded 3 -> 2 from the last checkpoint attempt 1 committed (at or after the one seen)
    staged_in_1 = {
        e["step"] for e in trainer_events(op_cluster, ns, master) if e["event"] == "staged"
    }
    restored, _ = _resumed(op_cluster, ns, f"{name}-a2-0", 2, committed[-1])
    assert restored["step"] in staged_in_1
    recovery_count = wait_for(
        lambda: metric_value(operator.metrics(), "ctj_job_recovery_seconds_count"),
        "a recovery observation in /metrics",
        15,
    )
    assert recovery_count >= 1

    # the machine comes back: after the 3 s window the job grows to 3 again
    committed_2 = wait_for(
        lambda: committed_steps(op_cluster, ns, f"{name}-a2-0"), "a commit at world 2", 60
    )
    op_cluster.restart_node(lost_node)
    st = wait_for(lambda: running(op_cluster, ns, name, 3, 3), "attempt 3 at world size 3", 90)
    assert (st["nodeRestarts"], st["restarts"]) == (1, 0), "growing is not a failure"
    assert {c["type"]: c for c in st["conditions"]}["Restarted"]["reason"] == "ScaleUp"
    assert "ScaleUp" in {e.reason for e in job_events(op_cluster, ns, name)}
    # growing is planned: attempt 2 checkpointed the step it stopped at, nothing is lost
    restored, _ = _resumed(op_cluster, ns, f"{name}-a3-0", 3, committed_2[-1], periodic=False)
    trained = [
        e["step"] for e in trainer_events(op_cluster, ns, f"{name}-a2-0") if e["event"] == "step"
    ]
    assert restored["step"] == trained[-1], "steps lost on a planned scale-up"
    assert (
        metric_value(
            operator.metrics(), "ctj_job_restarts_total", reason="ScaleUp", cause="planned"
        )
        == 1
    )
    wait_for(
        lambda: all(attempt_of(p) == 3 for p in job_pods(op_cluster, ns, name)),
        "no pod of an older attempt left",
        30,
    )
