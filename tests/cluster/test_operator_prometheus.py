"""Losing a node and getting it back: the job shrinks to 2, resumes, and grows back to 3.

One job through the whole sequence (issue 5, tests 2 and 3): a node agent is killed
after a checkpoint committed; the job restarts at world size 2 from that checkpoint,
resharded 3 -> 2; the node returns, and after the stabilization window the job grows
back to 3, again from its last checkpoint.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.prometheus import Prometheus, PrometheusConfig, Target
from ctj_stack.jobs import (
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
    wait_resumed,
)

from tests.unit.test_alert_rules import RULES
from tests.unit.test_chart_files import DASHBOARD, dashboard_exprs

# what a series may be labelled with: the scrape's, the monitors', the metrics' own
ALLOWED_LABELS = {
    "__name__",
    "job",
    "instance",
    "namespace",
    "pod",
    "job_name",
    "stage",
    "kind",
    "tier",
    "le",
    "reason",
    "cause",
    "phase",
}

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
    restored, steps = wait_resumed(cluster, namespace, pod)
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
    # the survivors' node caches served what they hold; only the rest came from S3
    tiers = restored["bytes_by_tier"]
    assert tiers.get("local", 0) > 0 and tiers.get("s3", 0) < restored["bytes_fetched"], tiers
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


def test_prometheus_follows_the_job_through_a_node_loss_and_every_panel_has_data(
    op_cluster: Cluster,
    operator: OperatorProcess,
    job_namespace: str,
    new_job: NewJob,
    s3_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """A real Prometheus scrapes the operator and every rank's sidecar (found as the
    chart's PodMonitor would: the job's pods, port 9400, namespace/pod labels) while a
    job checkpoints, loses a node and is restored; then every query of the dashboard the
    chart ships returns data, and no series carries a credential or an unexpected label."""
    ns, name = job_namespace, "watched"
    config = PrometheusConfig(tmp_path / "prometheus", rule_files=[RULES])
    with Prometheus(config) as prom:
        prom.set_targets("ctj-operator", [Target(f"127.0.0.1:{operator.metrics_port}")])

        def follow_pods() -> None:
            pods = [p for p in job_pods(op_cluster, ns, name) if p.status.pod_ip]
            labels = {"namespace": ns, "pod": ""}
            targets = [
                Target(f"{p.status.pod_ip}:9400", {**labels, "pod": p.metadata.name})
                for p in pods
                if p.status.phase == "Running"
            ]
            prom.set_targets("ctj-sidecars", targets)

        def following(check: Callable[[], Any]) -> Callable[[], Any]:
            return lambda: (follow_pods(), check())[1]

        new_job(name, env=FAST_TRAINING, restartPolicy={"maxRestarts": 5, "backoffSeconds": 1})
        master = f"{name}-a1-0"
        wait_for(following(lambda: running(op_cluster, ns, name, 1, 3)), "attempt 1", 90)
        wait_for(following(lambda: committed_steps(op_cluster, ns, master)), "a commit", 120)
        wait_for(
            following(lambda: len(prom.query("ctj_checkpoint_last_committed_step > 0")) == 1),
            "Prometheus to scrape rank 0's commit",
            60,
        )
        victim = next(p for p in job_pods(op_cluster, ns, name) if p.metadata.name.endswith("-1"))
        op_cluster.kill_node(victim.spec.node_name)
        try:
            wait_for(following(lambda: running(op_cluster, ns, name, 2, 2)), "attempt 2", 120)
            wait_for(
                following(lambda: committed_steps(op_cluster, ns, f"{name}-a2-0")),
                "a commit at world size 2",
                90,
            )

            def current_targets_up() -> bool:
                follow_pods()
                up = {
                    t["labels"].get("pod", "operator")
                    for t in prom.active_targets()
                    if t["health"] == "up"
                }
                return {"operator", f"{name}-a2-0", f"{name}-a2-1"} <= up

            wait_for(current_targets_up, "the operator and attempt 2's sidecars up", 60)
            exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
            queries = {e: e.replace("$__rate_interval", "5m") for e in exprs}

            def empty() -> list[str]:
                follow_pods()
                return [e for e, q in queries.items() if not prom.query(q)]

            wait_for(lambda: not empty(), "every dashboard query to return data", 90)
        finally:
            op_cluster.restart_node(victim.spec.node_name)
        secrets = {s3_env["AWS_SECRET_ACCESS_KEY"], s3_env["AWS_ACCESS_KEY_ID"]}
        for series in prom.series('{__name__=~"ctj_.*"}'):
            assert set(series) <= ALLOWED_LABELS, series
            assert not secrets & set(series.values()), series
