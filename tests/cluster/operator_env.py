"""What the operator tests share: a 3-node cluster with the CRD, the operator as a
process (killable), and job manifests that run examples/train_fsdp.py."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from kubernetes import client

from tests.conftest import ROOT, free_port

CRD = Path(ROOT) / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml"
EXAMPLE = Path(ROOT) / "examples" / "job.yaml"
GROUP, VERSION, PLURAL = "training.ctj.dev", "v1alpha1", "checkpointedtrainingjobs"


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 120.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def op_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """Three Ready nodes (the jobs want 3) and the CRD, established."""
    c = Cluster(
        ClusterConfig(
            root=tmp_path_factory.mktemp("opcluster"), nodes=3, node_monitor_grace_period=8.0
        ),
        cluster_binaries,
    )
    c.start()
    try:
        c.kubectl("apply", "-f", str(CRD))
        c.kubectl(
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/checkpointedtrainingjobs.training.ctj.dev",
        )
        yield c
    finally:
        c.stop()


class OperatorProcess:
    """`python -m ctj_operator` against the cluster, its log in a file."""

    def __init__(self, cluster: Cluster, log: Path) -> None:
        self.cluster, self.log = cluster, log
        self.metrics_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ctj_operator",
                "--kubeconfig",
                str(self.cluster.kubeconfig),
                "--metrics-port",
                str(self.metrics_port),
                "--liveness-port",
                str(free_port()),
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log, "a"),  # noqa: SIM115
            cwd=ROOT,
            env=dict(os.environ),
        )

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def metrics(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics") as r:
            return r.read().decode()


@pytest.fixture
def operator(op_cluster: Cluster, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = OperatorProcess(op_cluster, tmp_path / "operator.log")
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
    core.delete_namespace(name)


def job_manifest(name: str, s3_uri: str, endpoint: str, **overrides: Any) -> dict[str, Any]:
    """examples/job.yaml as a user would adapt it: their bucket, endpoint, and image.

    The simulated nodes run commands on this machine, so the image's /app is ROOT.
    """
    job = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    job["metadata"]["name"] = name
    job["spec"]["checkpoint"].update(uri=s3_uri, endpoint=endpoint)
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer["workingDir"] = ROOT
    for key, value in overrides.items():
        job["spec"][key] = value
    return job


def custom(cluster: Cluster) -> client.CustomObjectsApi:
    return client.CustomObjectsApi(cluster.api_client())


def get_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return custom(cluster).get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def status(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    return get_job(cluster, namespace, name).get("status") or {}
