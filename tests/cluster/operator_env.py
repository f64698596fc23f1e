"""The operator tests' fixtures: a 3-node cluster with the CRD, the operator as a process
(killable), a namespace per test with the S3 credentials Secret. The helpers they use
live in the harness (ctj_stack.jobs), shared with the operator benchmarks."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctj_devcluster import Binaries, BinariesMissing, Cluster, ClusterConfig
from ctj_devcluster.kubeflow import KubeflowBuild
from ctj_devcluster.kueue import KueueBuild
from ctj_stack.jobs import (
    NODE_AGENT,
    NewJob,
    OperatorProcess,
    create_job,
    install_crd,
    job_manifest,
    print_pod_logs,
    wait_for,
)
from kubernetes import client


def kubeflow_build() -> KubeflowBuild:
    """The training-operator hack/cluster-binaries.sh built (skip, saying so, if not)."""
    try:
        return KubeflowBuild.find()
    except BinariesMissing as exc:
        pytest.skip(str(exc))


def kueue_build() -> KueueBuild:
    """Kueue as hack/cluster-binaries.sh built it (skip, saying so, if not)."""
    try:
        return KueueBuild.find()
    except BinariesMissing as exc:
        pytest.skip(str(exc))


@contextlib.contextmanager
def crd_cluster(root: Path, binaries: Binaries, **config: Any) -> Iterator[Cluster]:
    """Three simulated nodes (ClusterConfig's other fields as ``config`` says) and the CRD,
    established; stopped afterwards."""
    c = Cluster(ClusterConfig(root=root, nodes=3, **config), binaries)
    c.start()
    try:
        install_crd(c)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def op_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Three Ready nodes (the jobs want 3) and the CRD, established."""
    root = tmp_path_factory.mktemp("opcluster")
    with crd_cluster(root, cluster_binaries, node_monitor_grace_period=8.0) as c:
        yield c


@pytest.fixture
def operator(op_cluster: Cluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    # node agents on, as the chart has them (none runs on the simulated nodes: pods fall
    # back to S3, as they do while an agent is down)
    op = OperatorProcess(op_cluster, tmp_path / "operator.log", extra_args=NODE_AGENT)
    op.start()
    try:
        yield op
    finally:
        op.kill()
        print("---- operator log (tail) ----\n" + op.log.read_text()[-6000:])


@pytest.fixture
def job_namespace(op_cluster: Cluster, s3_env: dict[str, str]) -> Iterator[str]:
    """A namespace with the S3 credentials Secret the jobs reference."""
    core = client.CoreV1Api(op_cluster.api_client())
    name = f"job-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: core.list_namespaced_service_account(name).items, "default SA", 30)
    core.create_namespaced_secret(
        name,
        {
            "metadata": {"name": "s3-credentials"},
            "stringData": {
                "AWS_ACCESS_KEY_ID": s3_env["AWS_ACCESS_KEY_ID"],
                "AWS_SECRET_ACCESS_KEY": s3_env["AWS_SECRET_ACCESS_KEY"],
            },
        },
    )
    yield name
    print_pod_logs(op_cluster, name)  # pytest shows it when the test failed
    core.delete_namespace(name)
    # the pods share the host network: the next test's ranks must not meet these
    wait_for(lambda: not core.list_namespaced_pod(name).items, f"pods of {name} gone", 60)


@pytest.fixture
def new_job(
    op_cluster: Cluster,
    operator: OperatorProcess,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
) -> NewJob:
    """Creates jobs in the test's namespace, checkpointing to its bucket, the operator up."""

    def create(name: str, **manifest: Any) -> dict[str, Any]:
        job = job_manifest(name, s3_uri, s3_env["AWS_ENDPOINT_URL"], **manifest)
        return create_job(op_cluster, job_namespace, job)

    return create
