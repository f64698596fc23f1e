"""Never act on stale state: two replicas elect one leader, and a plan made from an
outdated job acts on nothing (the real API server refuses its first, conditional write)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster
from ctj_operator.apply import Api, apply
from ctj_operator.decisions import CreateAttempt, PatchStatus, Plan
from ctj_operator.render import Target, render_plan
from ctj_operator.spec import JobSpec
from ctj_stack.jobs import (
    FAST_TRAINING,
    OperatorProcess,
    create_job,
    custom,
    get_job,
    job_manifest,
    job_pods,
    running,
    wait_for,
)
from kubernetes import client

pytestmark = pytest.mark.cluster


def test_two_replicas_one_acts_and_the_other_takes_over_when_it_dies(
    op_cluster: Cluster,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
    tmp_path: Path,
) -> None:
    lease = f"ctj-leader-{uuid.uuid4().hex[:6]}"
    first = OperatorProcess(op_cluster, tmp_path / "first.log", lease=lease)
    first.start()
    wait_for(lambda: "became the leader" in first.log.read_text(), "the first to lead", 30)
    second = OperatorProcess(op_cluster, tmp_path / "second.log", lease=lease)
    second.start()  # returns once its ports listen: it answers /healthz as a standby
    try:
        wait_for(lambda: "standing by" in second.log.read_text(), "the second to stand by", 30)
        ns, name = job_namespace, "led"
        job = job_manifest(name, s3_uri, s3_env["AWS_ENDPOINT_URL"], env=FAST_TRAINING)
        job["spec"]["replicas"] = 2
        create_job(op_cluster, ns, job)
        wait_for(lambda: running(op_cluster, ns, name, 1, 2), "attempt 1 at 2", 120)
        assert name not in second.log.read_text(), "the standby acted on the job"

        first.kill()  # SIGKILL: no hand-over, the standby waits the Lease out
        scale = {"spec": {"replicas": 1}}
        custom(op_cluster).patch_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name, scale)
        wait_for(lambda: running(op_cluster, ns, name, 2, 1), "the new leader to resize", 120)
        assert "became the leader" in second.log.read_text()
        pods = job_pods(op_cluster, ns, name)
        assert sorted(p.metadata.name for p in pods if p.metadata.deletion_timestamp is None) == [
            f"{name}-a2-0"
        ]
    finally:
        for op in (first, second):
            op.kill()
            print(f"---- {op.log.name} (tail) ----\n{op.log.read_text()[-3000:]}")


def test_a_plan_from_a_stale_view_acts_on_nothing(
    op_cluster: Cluster, job_namespace: str, s3_uri: str, s3_env: dict[str, str]
) -> None:
    """No operator runs; the handler's apply is called with a body read before someone
    else wrote the job's status, as a lagging watch would give it."""
    ns, name = job_namespace, "stale"
    job = job_manifest(name, s3_uri, s3_env["AWS_ENDPOINT_URL"], replicas=1)
    create_job(op_cluster, ns, job)
    stale: dict[str, Any] = get_job(op_cluster, ns, name)
    custom(op_cluster).patch_namespaced_custom_object_status(
        GROUP, VERSION, ns, PLURAL, name, {"status": {"phase": "Running", "attempt": 7}}
    )
    spec = JobSpec.parse(stale["spec"])
    plan = Plan(
        (PatchStatus({"phase": "Running", "attempt": 1, "worldSize": 1}), CreateAttempt(1, 1))
    )
    rendered = render_plan(plan, Target(body=stale, spec=spec, uri=f"{s3_uri}/x"))
    api = Api.connect(op_cluster.api_client())
    outcome = apply(rendered, api, resource_version=stale["metadata"]["resourceVersion"])
    assert outcome.stale
    assert not job_pods(op_cluster, ns, name), "a stale plan created pods"
    now = get_job(op_cluster, ns, name)["status"]
    assert now["attempt"] == 7, "a stale plan overwrote newer status"
    leases = client.CoordinationV1Api(op_cluster.api_client()).list_namespaced_lease(ns)
    assert not leases.items
