"""Jobs that cannot work end clearly: crash loops stop at maxRestarts, bad specs are refused."""

from __future__ import annotations

import pytest
from ctj_devcluster import Cluster
from ctj_stack.jobs import NewJob, attempt_of, create_job, job_manifest, job_pods, status, wait_for
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster


def test_a_crash_loop_fails_the_job_after_max_restarts(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "crashes"
    new_job(
        name,
        command=["python", "-c", "import sys; print('bad luck'); sys.exit(1)"],
        replicas=2,
        restartPolicy={"maxRestarts": 1, "backoffSeconds": 0.5},
    )
    st = wait_for(
        lambda: (s := status(op_cluster, ns, name)).get("phase") == "Failed" and s,
        "the job to fail",
        90,
    )
    assert st["attempt"] == 2 and st["restarts"] == 1
    failed = {c["type"]: c for c in st["conditions"]}["Failed"]
    assert failed["reason"] == "MaxRestartsExceeded"
    assert "spec.restartPolicy.maxRestarts=1" in failed["message"]
    assert "PodFailed" == {c["type"]: c for c in st["conditions"]}["Restarted"]["reason"]
    # the pods were kept (in-place restart): attempt 2 ran in attempt 1's, its worker's last
    # line quoted as a failed container's would be
    assert st["carried"] == [f"{name}-a1-0", f"{name}-a1-1"], st
    assert "trainer exited 1: bad luck" in failed["message"], failed
    assert "bad luck" in op_cluster.container_log(ns, f"{name}-a1-0", "trainer")
    wait_for(lambda: not job_pods(op_cluster, ns, name), "the failed job's pods removed", 60)
    # and it stays failed: no attempt 3
    assert status(op_cluster, ns, name)["attempt"] == 2
    assert all(attempt_of(p) <= 2 for p in job_pods(op_cluster, ns, name))


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"replicas": 5, "maxReplicas": 4}, "spec.replicas"),
        ({"replicas": 2, "minReplicas": 3}, "spec.replicas"),
        ({"checkpoint": {"endpoint": "http://s3:9000"}}, "spec.checkpoint.uri"),
        ({"checkpoint": {"uri": "gs://bucket"}}, "spec.checkpoint.uri"),
        ({"backend": "mpi"}, "spec.backend"),
    ],
)
def test_the_api_server_refuses_a_bad_spec_naming_the_field(
    op_cluster: Cluster, job_namespace: str, change: dict[str, object], field: str
) -> None:
    job = job_manifest("bad", "s3://bucket/jobs", "http://s3:9000")
    job["spec"].update(change)
    with pytest.raises(ApiException) as refused:
        create_job(op_cluster, job_namespace, job)
    assert refused.value.status == 422
    assert field in refused.value.body, refused.value.body
