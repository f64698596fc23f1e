"""Backend pytorchjob: the operator creates a Kubeflow PyTorchJob per attempt and reads
its status back. Only the CRD is installed (no training-operator here), so the test plays
the Kubeflow controller: it checks the object and writes its status conditions."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctj_devcluster import Cluster
from kubernetes.client.exceptions import ApiException

from tests.cluster.operator_env import (
    NewJob,
    custom,
    status,
    wait_for,
)

pytestmark = pytest.mark.cluster
CRD = Path(__file__).parent / "data" / "pytorchjob-crd.yaml"
KF = ("kubeflow.org", "v1")


@pytest.fixture(scope="module")
def pytorchjob_crd(op_cluster: Cluster) -> Iterator[None]:
    op_cluster.kubectl("apply", "-f", str(CRD))
    op_cluster.kubectl(
        "wait", "--for=condition=Established", "--timeout=60s", "crd/pytorchjobs.kubeflow.org"
    )
    yield
    op_cluster.kubectl("delete", "-f", str(CRD), "--wait=false")


def _pytorchjob(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return custom(cluster).get_namespaced_custom_object(*KF, ns, "pytorchjobs", name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _set_condition(cluster: Cluster, ns: str, name: str, kind: str) -> None:
    """What the Kubeflow controller writes when the job ends."""
    conditions = [
        {"type": "Created", "status": "True", "reason": "PyTorchJobCreated"},
        {"type": "Running", "status": "False", "reason": "PyTorchJobRunning"},
        {"type": kind, "status": "True", "reason": f"PyTorchJob{kind}"},
    ]
    custom(cluster).patch_namespaced_custom_object_status(
        *KF, ns, "pytorchjobs", name, {"status": {"conditions": conditions}}
    )


def test_pytorchjob_backend_creates_the_job_and_follows_its_status(
    op_cluster: Cluster, pytorchjob_crd: None, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "kf"
    job = new_job(
        name,
        backend="pytorchjob",
        replicas=3,
        restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
    )
    uid = job["metadata"]["uid"]
    ptj = wait_for(lambda: _pytorchjob(op_cluster, ns, f"{name}-a1"), "PyTorchJob a1", 30)

    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] == 1 and replicas["Worker"]["replicas"] == 2
    assert ptj["spec"]["runPolicy"]["backoffLimit"] == 0
    for kind in ("Master", "Worker"):
        pod_spec = replicas[kind]["template"]["spec"]
        assert [c["name"] for c in pod_spec["containers"]] == ["pytorch"]
        sidecar = pod_spec["initContainers"][-1]
        assert sidecar["name"] == "ctj-sidecar" and sidecar["restartPolicy"] == "Always"
        assert {"name": "ctj-staging", "mountPath": "/ctj/staging"} in pod_spec["containers"][0][
            "volumeMounts"
        ]
        assert any(v["name"] == "ctj-staging" for v in pod_spec["volumes"])
        env = {e["name"] for e in pod_spec["containers"][0]["env"]}
        assert {"CTJ_CHECKPOINT_URI", "AWS_ACCESS_KEY_ID", "CTJ_ATTEMPT"} <= env
        assert "MASTER_ADDR" not in env, "the Kubeflow controller sets the rendezvous"
    (owner,) = ptj["metadata"]["ownerReferences"]
    assert owner["kind"] == "CheckpointedTrainingJob" and owner["uid"] == uid
    st = status(op_cluster, ns, name)
    assert st["phase"] == "Running" and st["worldSize"] == 3 and st["attempt"] == 1

    # the PyTorchJob fails: a new attempt, a new PyTorchJob, the old one deleted
    _set_condition(op_cluster, ns, f"{name}-a1", "Failed")
    st = wait_for(
        lambda: (
            (s := status(op_cluster, ns, name)).get("attempt") == 2
            and s.get("phase") == "Running"
            and s.get("podsCreated")
            and s
        ),
        "attempt 2",
        30,
    )
    assert st["restarts"] == 1
    assert {c["type"]: c for c in st["conditions"]}["Restarted"]["reason"] == "PodFailed"
    wait_for(lambda: _pytorchjob(op_cluster, ns, f"{name}-a2"), "PyTorchJob a2", 30)
    wait_for(lambda: _pytorchjob(op_cluster, ns, f"{name}-a1") is None, "a1 deleted", 30)

    # it succeeds: so does the ctj job
    _set_condition(op_cluster, ns, f"{name}-a2", "Succeeded")
    st = wait_for(
        lambda: (s := status(op_cluster, ns, name)).get("phase") == "Succeeded" and s,
        "the job to succeed",
        30,
    )
    assert st["attempt"] == 2 and {c["type"] for c in st["conditions"]} >= {"Succeeded"}
