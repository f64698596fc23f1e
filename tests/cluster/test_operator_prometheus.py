"""A real Prometheus follows a job through a node loss: every panel of the chart's
dashboard has data for the job, the job's series keep their namespace and job_name
through the restart, and no series carries a credential or an unexpected label. (The
node loss itself, its return and the rest of a job's life: test_operator_lifecycle.py.)"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from ctj_contract import LABEL_JOB
from ctj_devcluster import Cluster
from ctj_devcluster.prometheus import Prometheus, PrometheusConfig, Target
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    OperatorProcess,
    attempt_of,
    committed_steps,
    job_pods,
    rank0_events,
    running,
    wait_for,
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
    "rank",  # the per-rank histograms (stall, upload, restore): at most slots.MAX_RANKS values
    "le",
    "reason",
    "cause",
    "phase",
    "version",
    "component",
}

pytestmark = pytest.mark.cluster


def test_prometheus_follows_the_job_through_a_node_loss_and_every_panel_has_data(
    op_cluster: Cluster,
    operator: OperatorProcess,
    job_namespace: str,
    new_job: NewJob,
    s3_env: dict[str, str],
    tmp_path: Path,
) -> None:
    """A real Prometheus scrapes the operator and every rank's sidecar (found as the
    chart's PodMonitor would: the job's pods, port 9400, namespace/pod labels and job_name
    from the pod's job-name label) while a job checkpoints, loses a node and is restored;
    the job's series keep their labels through the restart (the operator's one series per
    job advances, the sidecars' of both attempts name the job); every query of the
    dashboard the chart ships returns data for the job; and no series carries a credential
    or an unexpected label."""
    ns, name = job_namespace, "watched"
    config = PrometheusConfig(tmp_path / "prometheus", rule_files=[RULES])
    with Prometheus(config) as prom:
        prom.set_targets("ctj-operator", [Target(f"127.0.0.1:{operator.metrics_port}")])

        def follow_pods() -> None:
            pods = [p for p in job_pods(op_cluster, ns, name) if p.status.pod_ip]
            targets = [
                Target(
                    f"{p.status.pod_ip}:9400",
                    {
                        "namespace": p.metadata.namespace,
                        "job_name": p.metadata.labels[LABEL_JOB],
                        "pod": p.metadata.name,
                    },
                )
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
        # the operator's series of the job (status.lastCheckpoint), which outlive its pods
        of_job = f'{{namespace="{ns}", job_name="{name}"}}'
        operator_step = f"ctj_job_last_checkpoint_step{of_job}"
        wait_for(
            following(lambda: prom.query(f"{operator_step} > 0")),
            "the operator to export the job's last checkpoint",
            60,
        )
        (before,) = prom.query(operator_step)
        victim = next(p for p in job_pods(op_cluster, ns, name) if p.metadata.name.endswith("-1"))
        op_cluster.kill_node(victim.spec.node_name)
        try:
            wait_for(following(lambda: running(op_cluster, ns, name, 2, 2)), "attempt 2", 120)
            wait_for(
                following(
                    lambda: [
                        e
                        for e in rank0_events(op_cluster, ns, name, 2)
                        if e["event"] == "committed"
                    ]  # fmt: skip
                ),
                "a commit at world size 2",
                90,
            )
            # the survivors, kept (in-place restart): attempt 2's pods are attempt 1's
            attempt_2 = {p.metadata.name for p in job_pods(op_cluster, ns, name)
                         if attempt_of(p) == 2}  # fmt: skip
            assert attempt_2 == {f"{name}-a1-0", f"{name}-a1-2"}, attempt_2

            def current_targets_up() -> bool:
                follow_pods()
                up = {
                    t["labels"].get("pod", "operator")
                    for t in prom.active_targets()
                    if t["health"] == "up"
                }
                return {"operator", *attempt_2} <= up

            wait_for(current_targets_up, "the operator and attempt 2's sidecars up", 60)

            # one series of the job, the same labels, through the restart; its step advanced
            def advanced() -> bool:
                follow_pods()
                now = prom.query(operator_step)
                return len(now) == 1 and float(now[0]["value"][1]) > float(before["value"][1])

            wait_for(advanced, "the operator's series of the job to advance in attempt 2", 60)
            (after,) = prom.query(operator_step)
            assert after["metric"] == before["metric"], (before, after)
            # the sidecars' series of both attempts, the lost pod's too, all name the job
            sidecar_steps = prom.series(f"ctj_checkpoint_last_committed_step{of_job}")
            pods = {s["pod"] for s in sidecar_steps}
            assert {f"{name}-a1-0"} <= pods, pods
            assert {(s["namespace"], s["job_name"]) for s in sidecar_steps} == {(ns, name)}
            exprs = dashboard_exprs(json.loads(DASHBOARD.read_text()))
            queries = {
                e: e.replace("$__rate_interval", "5m")
                .replace("$namespace", ns)
                .replace("$job", name)
                for e in exprs
            }

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
