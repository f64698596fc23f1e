"""The real sidecar process heartbeats a real Lease, with only the access the operator will
grant its pod (get, patch on that one Lease): renewTime advances, rank 0 reports its last
commit, a checkpoint request reaches the trainer, a deleted Lease is logged and the
persisting goes on, and SIGTERM ends the heartbeat (joined) and the process with 0."""

from __future__ import annotations

import datetime
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ctj_contract import ANNOTATION_CHECKPOINT_REQUEST as CHECKPOINT_REQUEST
from ctj_contract import ANNOTATION_LAST_CHECKPOINT as LAST_CHECKPOINT
from ctj_contract import micro_time
from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until
from kubernetes import client

from tests.integration.ranks import run_ranks
from tests.integration.test_sidecar import Sidecar, big_model, sidecar_config
from trainer_sidecar import Checkpointer
from trainer_sidecar.config import job_staging_dir
from trainer_sidecar.store import repository as repo

pytestmark = pytest.mark.cluster
PERIOD_S = 0.2


def coordination(cluster: Cluster) -> client.CoordinationV1Api:
    return client.CoordinationV1Api(cluster.api_client())


def create_lease(cluster: Cluster, namespace: str, name: str) -> None:
    """What the operator creates before the pod: named after it, held by it."""
    coordination(cluster).create_namespaced_lease(
        namespace,
        {
            "metadata": {"name": name},
            "spec": {
                "holderIdentity": name,
                "leaseDurationSeconds": 10,
                "renewTime": micro_time(time.time()),
            },
        },
    )


def read_lease(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    api = coordination(cluster)
    raw = api.read_namespaced_lease(name, namespace, _preload_content=False)
    lease: dict[str, Any] = json.loads(raw.data)
    return lease


def renew_time(lease: dict[str, Any]) -> datetime.datetime:
    return datetime.datetime.strptime(lease["spec"]["renewTime"], "%Y-%m-%dT%H:%M:%S.%fZ").replace(
        tzinfo=datetime.UTC
    )


def annotation(lease: dict[str, Any], key: str) -> str | None:
    return ((lease.get("metadata") or {}).get("annotations") or {}).get(key)


def service_account_kubeconfig(cluster: Cluster, namespace: str, sa: str, path: Path) -> Path:
    """A kubeconfig that is the service account (its token), as the pod would be."""
    return cluster.service_account_kubeconfig(namespace, sa, path)


@pytest.fixture
def pod_lease(cluster: Cluster, namespace: str, tmp_path: Path) -> tuple[str, Path]:
    """The Lease of pod "job-1-0" and a kubeconfig of a service account that may only get and
    patch it (what the operator grants the pod's service account)."""
    lease, sa = "job-1-0", "trainer"
    create_lease(cluster, namespace, lease)
    core = client.CoreV1Api(cluster.api_client())
    core.create_namespaced_service_account(namespace, {"metadata": {"name": sa}})
    rbac = client.RbacAuthorizationV1Api(cluster.api_client())
    rbac.create_namespaced_role(
        namespace,
        {
            "metadata": {"name": "heartbeat"},
            "rules": [
                {
                    "apiGroups": ["coordination.k8s.io"],
                    "resources": ["leases"],
                    "resourceNames": [lease],
                    "verbs": ["get", "patch"],
                }
            ],
        },
    )
    rbac.create_namespaced_role_binding(
        namespace,
        {
            "metadata": {"name": "heartbeat"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "Role",
                "name": "heartbeat",
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}],
        },
    )
    who = f"--as=system:serviceaccount:{namespace}:{sa}"

    def can_i(*what: str) -> str:
        return cluster.kubectl("auth", "can-i", who, *what, "-n", namespace, check=False).stdout

    wait_until(lambda: can_i("patch", f"leases/{lease}").strip() == "yes", timeout=30, what="RBAC")
    assert can_i("patch", "leases/job-1-1").strip() == "no"  # only its own Lease
    assert can_i("list", "leases").strip() == "no"
    return lease, service_account_kubeconfig(cluster, namespace, sa, tmp_path / "sa.kubeconfig")


@pytest.fixture
def heartbeat_env(
    pod_lease: tuple[str, Path], namespace: str, monkeypatch: pytest.MonkeyPatch
) -> str:
    """The environment the operator gives the rank-0 pod's sidecar (Sidecar passes ours on)."""
    lease, kubeconfig = pod_lease
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.setenv("CTJ_HEARTBEAT_LEASE", lease)
    monkeypatch.setenv("CTJ_POD_NAMESPACE", namespace)
    monkeypatch.setenv("CTJ_HEARTBEAT_PERIOD_S", str(PERIOD_S))
    monkeypatch.setenv("NODE_RANK", "0")
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):  # not in-cluster here
        monkeypatch.delenv(var, raising=False)
    return lease


@pytest.fixture
def sidecars() -> Iterator[list[Sidecar]]:
    started: list[Sidecar] = []
    yield started
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()
        print(f"---- sidecar log (tail) ----\n{s.text()[-4000:]}")


def wait_renewed_after(
    cluster: Cluster, namespace: str, lease: str, after: datetime.datetime
) -> datetime.datetime:
    def renewed() -> datetime.datetime | None:
        t = renew_time(read_lease(cluster, namespace, lease))
        return t if t > after else None

    found = wait_until(renewed, timeout=30, what=f"Lease {lease} renewed after {after}")
    assert isinstance(found, datetime.datetime)
    return found


def last_checkpoint(cluster: Cluster, namespace: str, lease: str) -> dict[str, Any] | None:
    value = annotation(read_lease(cluster, namespace, lease), LAST_CHECKPOINT)
    return json.loads(value) if value else None


def test_rank0_renews_reports_its_commit_and_passes_on_checkpoint_requests(
    cluster: Cluster,
    namespace: str,
    heartbeat_env: str,
    s3_uri: str,
    tmp_path: Path,
    sidecars: list[Sidecar],
) -> None:
    lease, staging = heartbeat_env, tmp_path / "staging"
    created = renew_time(read_lease(cluster, namespace, lease))
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log")
    sidecars.append(sidecar)
    first = wait_renewed_after(cluster, namespace, lease, created)
    wait_renewed_after(cluster, namespace, lease, first)  # it goes on beating
    assert last_checkpoint(cluster, namespace, lease) is None  # nothing committed yet

    # a trainer process (sidecar mode) saves step 3; the sidecar commits it and reports it
    args = {
        "kind": "ddp",
        "uri": s3_uri,
        "step": 3,
        "ref": str(tmp_path / "ref.pt"),
        "config": {"sidecar": True, "staging_dir": str(staging)},
    }
    run_ranks(1, "tests.integration.workers:save", args, timeout=120)
    manifest = repo.latest_manifest(Checkpointer(sidecar_config(s3_uri, staging)).store)
    assert manifest is not None and manifest.step == 3
    reported = wait_until(
        lambda: last_checkpoint(cluster, namespace, lease),
        timeout=30,
        what="rank 0's last-checkpoint annotation",
    )
    assert reported == {
        "step": 3,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(manifest.created)),
        "bytes": manifest.logical_bytes,
    }

    # the operator asks for a checkpoint: the trainer's next boundary sees it
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    request = job_staging_dir(trainer.config) / "checkpoint-request"
    assert not trainer.preemption_requested()  # no process group: the local answer
    for request_id in ("resize-1", "resize-2"):
        coordination(cluster).patch_namespaced_lease(
            lease, namespace, {"metadata": {"annotations": {CHECKPOINT_REQUEST: request_id}}}
        )
        wait_until(
            lambda rid=request_id: request.exists() and request.read_text() == rid,
            timeout=30,
            what=f"{request} to hold {request_id}",
        )
        assert trainer.preemption_requested()
        assert trainer.checkpoint_request() == request_id
    assert request.parent.stat().st_mode & 0o777 == 0o700
    assert f"renewing Lease {namespace}/{lease} failed" not in sidecar.text(), sidecar.text()


def test_a_deleted_lease_is_logged_persisting_goes_on_and_sigterm_ends_the_heartbeat(
    cluster: Cluster,
    namespace: str,
    heartbeat_env: str,
    s3_uri: str,
    tmp_path: Path,
    sidecars: list[Sidecar],
) -> None:
    lease, staging = heartbeat_env, tmp_path / "staging"
    created = renew_time(read_lease(cluster, namespace, lease))
    sidecar = Sidecar(s3_uri, staging, tmp_path / "sidecar.log", grace=60)
    sidecars.append(sidecar)
    wait_renewed_after(cluster, namespace, lease, created)

    def failures() -> float:
        text = sidecar.get("/metrics")[1]
        line = next(x for x in text.splitlines() if x.startswith("ctj_heartbeat_failures_total "))
        return float(line.split()[-1])

    coordination(cluster).delete_namespaced_lease(lease, namespace)
    wait_until(lambda: "not found" in sidecar.text(), timeout=30, what="the sidecar to log the 404")
    trainer = Checkpointer(sidecar_config(s3_uri, staging))
    assert trainer.save(1, model=torch.nn.Linear(8, 8)).result().step == 1  # type: ignore[union-attr]
    wait_until(lambda: failures() >= 5, timeout=30, what="5 failed beats")
    assert sidecar.proc.poll() is None
    failed = [line for line in sidecar.text().splitlines() if "failed:" in line]
    assert len(failed) == 1, failed  # one line, not one a beat
    assert f"renewing Lease {namespace}/{lease} failed: 404 Not Found" in failed[0]

    # the Lease is back (same name): renewed again, and rank 0's commit is reported again
    create_lease(cluster, namespace, lease)
    wait_until(lambda: "works again" in sidecar.text(), timeout=30, what="the recovery line")
    reported = wait_until(
        lambda: last_checkpoint(cluster, namespace, lease),
        timeout=30,
        what="last-checkpoint on the new Lease",
    )
    assert isinstance(reported, dict) and reported["step"] == 1

    # SIGTERM while an upload is in flight: it beats on, commits, reports, then exits 0
    trainer.save(2, model=big_model())
    wait_until(lambda: "uploading step 2" in sidecar.text(), timeout=60, what="the upload")
    terminated = datetime.datetime.now(datetime.UTC)
    sidecar.signal(signal.SIGTERM)
    assert sidecar.wait() == 0, sidecar.text()
    trainer.close()
    log = sidecar.text()
    order = ["got SIGTERM", "committed step 2", "heartbeat stopped", "exiting"]
    assert [log.index(x) for x in order] == sorted(log.index(x) for x in order), log[-3000:]
    final = read_lease(cluster, namespace, lease)
    assert renew_time(final) > terminated
    assert json.loads(annotation(final, LAST_CHECKPOINT) or "{}")["step"] == 2
