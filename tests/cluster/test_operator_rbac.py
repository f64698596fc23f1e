"""Least privilege: deploy/operator-rbac.yaml grants exactly the verbs the operator uses,
and the operator runs with nothing more (its own service account's token)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.binaries import BinariesMissing
from ctj_devcluster.kubeflow import install_crd as install_pytorchjob_crd
from ctj_devcluster.kueue import install_crds as install_kueue_crds
from ctj_devcluster.trainer import install_trainer_crds
from ctj_stack.jobs import (
    FAST_TRAINING,
    NODE_AGENT,
    OperatorProcess,
    core,
    create_job,
    job_manifest,
    running,
    status,
    wait_for,
)

from tests.cluster.operator_env import kubeflow_build, kueue_build
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster
RBAC = Path(ROOT) / "deploy" / "operator-rbac.yaml"
SA = "system:serviceaccount:ctj-system:ctj-operator"

ALLOWED = [
    ("get", "checkpointedtrainingjobs.training.ctj.dev", ""),
    ("list", "checkpointedtrainingjobs.training.ctj.dev", ""),
    ("watch", "checkpointedtrainingjobs.training.ctj.dev", ""),
    ("patch", "checkpointedtrainingjobs.training.ctj.dev", ""),  # kopf's annotations
    ("delete", "checkpointedtrainingjobs.training.ctj.dev", ""),  # ttlSecondsAfterFinished
    ("patch", "checkpointedtrainingjobs.training.ctj.dev", "status"),
    ("list", "pods", ""),
    ("watch", "pods", ""),
    ("create", "pods", ""),
    ("patch", "pods", ""),  # a survivor's labels, kept for the next attempt
    ("delete", "pods", ""),
    ("create", "services", ""),
    ("create", "secrets", ""),  # a job's peer-cache token; never read back
    ("create", "networkpolicies.networking.k8s.io", ""),  # a job's own policy
    ("list", "nodes", ""),
    ("watch", "nodes", ""),
    ("create", "events", ""),
    ("get", "pytorchjobs.kubeflow.org", ""),
    ("watch", "pytorchjobs.kubeflow.org", ""),
    ("create", "pytorchjobs.kubeflow.org", ""),
    ("delete", "pytorchjobs.kubeflow.org", ""),
    ("get", "trainjobs.trainer.kubeflow.org", ""),
    ("watch", "trainjobs.trainer.kubeflow.org", ""),
    ("create", "trainjobs.trainer.kubeflow.org", ""),
    ("delete", "trainjobs.trainer.kubeflow.org", ""),
    ("create", "trainingruntimes.trainer.kubeflow.org", ""),
    ("delete", "trainingruntimes.trainer.kubeflow.org", ""),
    ("create", "workloads.kueue.x-k8s.io", ""),
    ("watch", "workloads.kueue.x-k8s.io", ""),
    ("delete", "workloads.kueue.x-k8s.io", ""),
    ("patch", "workloads.kueue.x-k8s.io", "status"),
    ("watch", "resourceflavors.kueue.x-k8s.io", ""),
    ("watch", "workloadpriorityclasses.kueue.x-k8s.io", ""),
]
DENIED = [
    ("update", "pods", ""),
    ("create", "pods", "exec"),
    ("get", "secrets", ""),  # the last checkpoint comes from the job, not from S3
    ("list", "secrets", ""),
    ("delete", "secrets", ""),
    ("create", "nodes", ""),
    ("patch", "nodes", ""),
    ("delete", "services", ""),  # the garbage collector removes them
    ("get", "trainingruntimes.trainer.kubeflow.org", ""),  # written whole, never read
    ("create", "checkpointedtrainingjobs.training.ctj.dev", ""),
    ("update", "checkpointedtrainingjobs.training.ctj.dev", "status"),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", ""),
    ("create", "clusterroles.rbac.authorization.k8s.io", ""),
    ("bind", "roles.rbac.authorization.k8s.io", ""),
    ("escalate", "roles.rbac.authorization.k8s.io", ""),
    ("create", "deployments.apps", ""),
    ("create", "serviceaccounts", "token"),
    # no Roles (it could grant itself anything), no Lease it does not own
    ("create", "roles.rbac.authorization.k8s.io", ""),
    ("patch", "roles.rbac.authorization.k8s.io", ""),
    ("create", "rolebindings.rbac.authorization.k8s.io", ""),
    ("create", "leases.coordination.k8s.io", ""),
    ("update", "leases.coordination.k8s.io", ""),
    ("patch", "leases.coordination.k8s.io", ""),
    ("deletecollection", "leases.coordination.k8s.io", ""),
    ("watch", "leases.coordination.k8s.io", ""),
    # Kueue's: it admits, the operator never edits a queue, a flavor or a Workload's spec
    ("patch", "workloads.kueue.x-k8s.io", ""),
    ("update", "workloads.kueue.x-k8s.io", "status"),
    ("create", "clusterqueues.kueue.x-k8s.io", ""),
    ("patch", "localqueues.kueue.x-k8s.io", ""),
    ("create", "resourceflavors.kueue.x-k8s.io", ""),
]
# Leases: its leader Lease in its own namespace, the kubelets' read-only
LEASES = [
    ("create", "leases.coordination.k8s.io", "ctj-system", "yes"),
    ("update", "leases.coordination.k8s.io/ctj-operator", "ctj-system", "yes"),
    ("update", "leases.coordination.k8s.io/another", "ctj-system", "no"),
    ("watch", "leases.coordination.k8s.io", "kube-node-lease", "yes"),
    ("update", "leases.coordination.k8s.io", "kube-node-lease", "no"),
    ("update", "leases.coordination.k8s.io", "kube-system", "no"),
]


@pytest.fixture(scope="module")
def rbac(op_cluster: Cluster) -> Iterator[None]:
    # kubectl auth can-i resolves resources by discovery: the PyTorchJob API must exist
    install_pytorchjob_crd(op_cluster, kubeflow_build())
    install_kueue_crds(op_cluster, kueue_build())
    try:
        install_trainer_crds(op_cluster)
    except BinariesMissing as exc:
        pytest.skip(str(exc))
    op_cluster.kubectl("create", "namespace", "ctj-system")
    op_cluster.kubectl("apply", "-f", str(RBAC))
    yield
    op_cluster.kubectl("delete", "-f", str(RBAC), "--wait=false", check=False)
    op_cluster.kubectl("delete", "namespace", "ctj-system", "--wait=false", check=False)


def can_i(cluster: Cluster, verb: str, resource: str, subresource: str, ns: str) -> str:
    args = ["auth", "can-i", f"--as={SA}", verb, resource, "-n", ns]
    if subresource:
        args.append(f"--subresource={subresource}")
    return cluster.kubectl(*args, check=False).stdout.strip()


@pytest.mark.parametrize(("verb", "resource", "sub"), ALLOWED)
def test_each_verb_the_operator_uses_is_allowed(
    op_cluster: Cluster, rbac: None, verb: str, resource: str, sub: str
) -> None:
    assert can_i(op_cluster, verb, resource, sub, "some-team") == "yes"


@pytest.mark.parametrize(("verb", "resource", "sub"), DENIED)
def test_what_it_does_not_use_is_denied(
    op_cluster: Cluster, rbac: None, verb: str, resource: str, sub: str
) -> None:
    assert can_i(op_cluster, verb, resource, sub, "some-team") == "no"


@pytest.mark.parametrize(("verb", "resource", "ns", "answer"), LEASES)
def test_leases_only_its_own_and_the_kubelets_read_only(
    op_cluster: Cluster, rbac: None, verb: str, resource: str, ns: str, answer: str
) -> None:
    assert can_i(op_cluster, verb, resource, "", ns) == answer


def test_the_operator_runs_a_job_with_only_its_service_account(
    op_cluster: Cluster,
    rbac: None,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
    tmp_path: Path,
) -> None:
    kubeconfig = op_cluster.service_account_kubeconfig(
        "ctj-system", "ctj-operator", tmp_path / "ctj-operator.kubeconfig"
    )
    # as the chart runs it: its leader Lease by name in its own namespace, node agents on
    operator = OperatorProcess(
        op_cluster,
        tmp_path / "operator.log",
        kubeconfig,
        (*NODE_AGENT, "--leader-election-namespace", "ctj-system"),
        lease="ctj-operator",
    )
    operator.start()
    try:
        ns, name = job_namespace, "least"
        create_job(
            op_cluster,
            ns,
            job_manifest(name, s3_uri, s3_env["AWS_ENDPOINT_URL"], env=FAST_TRAINING, replicas=2),
        )
        wait_for(lambda: running(op_cluster, ns, name, 1, 2), "the job to run", 90)
        last = wait_for(
            lambda: status(op_cluster, ns, name).get("lastCheckpoint"),
            "the last checkpoint in status (reported by rank 0's sidecar, no Secret read)",
            60,
        )
        assert last["step"] >= 10
        assert core(op_cluster).read_namespaced_secret(f"{name}-ctj-cache", ns).data["token"]
        log = operator.log.read_text()
        # any refusal, however it is worded (kopf: "status=403", the client: "(403)", the API
        # server: "... is forbidden: User ..."), but not a timestamp's milliseconds (",403")
        refused = re.search(r"(?i)forbidden|status[=: ]+403|\(403\)", log)
        assert refused is None, log[-3000:]
    finally:
        operator.kill()
        print("---- operator log (tail) ----\n" + operator.log.read_text()[-4000:])
