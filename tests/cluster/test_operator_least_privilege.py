"""The chart installed in its namespaced mode (operator.watchNamespaces), asked of a real
API server with `kubectl auth can-i --as=<the operator's ServiceAccount>`: what a
compromised operator could not do (read Secrets, write kube-system's or any other Lease
but its own, create Roles or RoleBindings, create pods outside its namespaces) and what
it must still do to run jobs. docs/security.md, "RBAC", is the table these check.

The operator pod itself is pinned to no node (the simulated nodes would run its command
on this host); the rights are the install's, not the process's.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until

from tests.unit.chart_helm import CHART

pytestmark = pytest.mark.cluster

CRD_NAME = "checkpointedtrainingjobs.training.ctj.dev"
CTJ = CRD_NAME
LEASES = "leases.coordination.k8s.io"


@dataclass(frozen=True)
class Install:
    release: str
    system: str  # the release namespace
    watched: str  # the one namespace it watches
    other: str  # a namespace it does not watch

    @property
    def account(self) -> str:
        return f"system:serviceaccount:{self.system}:{self.release}"


@pytest.fixture(scope="module")
def install(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Install]:
    suffix = uuid.uuid4().hex[:6]
    it = Install(f"ctj-{suffix}", f"ctj-system-{suffix}", f"team-{suffix}", f"other-{suffix}")
    crd_existed = cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    for ns in (it.system, it.watched, it.other):
        cluster.kubectl("create", "namespace", ns)
    values = tmp_path_factory.mktemp("least-privilege") / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "operator": {"watchNamespaces": [it.watched]},
                "replicaCount": 1,
                "nodeSelector": {"ctj.dev/test-no-such-node": "true"},
            }
        )
    )
    try:
        cluster.helm("install", it.release, str(CHART), "-n", it.system, "-f", str(values))
        wait_until(
            lambda: "True" in cluster.kubectl(
                "get", "crd", CRD_NAME, "-o",
                "jsonpath={.status.conditions[?(@.type=='Established')].status}", check=False,
            ).stdout,
            timeout=30,
            what=f"CRD {CRD_NAME} served",
        )  # fmt: skip
        yield it
    finally:
        cluster.helm("uninstall", it.release, "-n", it.system, check=False)
        for ns in (it.system, it.watched, it.other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)
        if not crd_existed:  # leave the session cluster as we found it
            cluster.kubectl("delete", "crd", CRD_NAME, "--timeout=60s", check=False)


# (verb, resource, where): where is "watched", "system" (the release namespace), "other"
# (not watched), a namespace's own name, or None (every namespace / cluster-scoped)
CANNOT = [
    # Secrets: created for a job, never read, anywhere
    ("get", "secrets", "watched"),
    ("list", "secrets", "watched"),
    ("watch", "secrets", "watched"),
    ("get", "secrets", "system"),
    ("get", "secrets", "kube-system"),
    ("list", "secrets", None),
    # Leases it does not own: the control plane's, the kubelets', a job namespace's
    ("update", LEASES, "kube-system"),
    ("create", LEASES, "kube-system"),
    ("patch", LEASES, "kube-system"),
    ("delete", LEASES, "kube-system"),
    ("update", LEASES, "kube-node-lease"),
    ("delete", LEASES, "kube-node-lease"),
    ("create", LEASES, "watched"),
    ("update", f"{LEASES}/someone-elses", "system"),
    ("delete", LEASES, "system"),
    # no Role or RoleBinding: it could grant itself anything
    ("create", "roles.rbac.authorization.k8s.io", "watched"),
    ("patch", "roles.rbac.authorization.k8s.io", "watched"),
    ("create", "rolebindings.rbac.authorization.k8s.io", "watched"),
    ("create", "roles.rbac.authorization.k8s.io", "system"),
    ("create", "clusterroles.rbac.authorization.k8s.io", None),
    ("create", "clusterrolebindings.rbac.authorization.k8s.io", None),
    # nothing outside its namespaces
    ("create", "pods", "other"),
    ("create", "pods", "kube-system"),
    ("create", "pods", "system"),
    ("delete", "pods", "other"),
    ("create", "secrets", "other"),
    ("create", "services", "other"),
    ("list", "pods", "other"),
    ("patch", f"{CTJ}#status", "other"),
    ("create", "pods", None),
    # and in them, nothing it does not use
    ("update", "pods", "watched"),
    ("create", "pods#exec", "watched"),
    ("create", "serviceaccounts#token", "watched"),
    ("create", "deployments.apps", "watched"),
    ("patch", "nodes", None),
]
CAN = [
    ("create", "pods", "watched"),
    ("delete", "pods", "watched"),
    ("list", "pods", "watched"),
    ("watch", "pods", "watched"),
    ("create", "services", "watched"),
    ("create", "secrets", "watched"),  # a job's token, by secretKeyRef to its pods
    ("create", "networkpolicies.networking.k8s.io", "watched"),
    ("create", "events", "watched"),
    ("watch", CTJ, "watched"),
    ("patch", CTJ, "watched"),
    ("patch", f"{CTJ}#status", "watched"),
    ("list", "nodes", None),
    ("watch", "nodes", None),
    ("create", LEASES, "system"),  # its leader Lease, the first time
    ("update", f"{LEASES}/ctj-operator", "system"),  # ... then that one only
    ("get", f"{LEASES}/ctj-operator", "system"),
    ("list", LEASES, "kube-node-lease"),  # kubelets, read-only
    ("watch", LEASES, "kube-node-lease"),
]


def _where(install: Install, where: str | None) -> str | None:
    named = {"watched": install.watched, "system": install.system, "other": install.other}
    return named.get(where, where) if where is not None else None


def _ask(cluster: Cluster, install: Install, verb: str, resource: str, where: str | None) -> str:
    """The API server's authorizer's answer ("yes" or "no") for the operator's account.
    ``resource``: "kind", "kind/name", or "kind#subresource"."""
    resource, _, sub = resource.partition("#")
    args = ["auth", "can-i", verb, resource, f"--as={install.account}"]
    ns = _where(install, where)
    args += ["-n", ns] if ns is not None else ["--all-namespaces"]
    args += [f"--subresource={sub}"] if sub else []
    answer = cluster.kubectl(*args, check=False)
    assert answer.stdout.strip() in ("yes", "no"), answer.stderr
    return answer.stdout.strip()


@pytest.mark.parametrize(("verb", "resource", "where"), CANNOT)
def test_the_operator_cannot(
    cluster: Cluster, install: Install, verb: str, resource: str, where: str | None
) -> None:
    assert _ask(cluster, install, verb, resource, where) == "no"


@pytest.mark.parametrize(("verb", "resource", "where"), CAN)
def test_the_operator_can_still_run_jobs(
    cluster: Cluster, install: Install, verb: str, resource: str, where: str | None
) -> None:
    assert _ask(cluster, install, verb, resource, where) == "yes"


def test_the_chart_made_no_cluster_wide_write(cluster: Cluster, install: Install) -> None:
    """Namespaced mode: the only ClusterRoleBinding to the operator binds reads of Nodes
    and of Kueue's cluster-scoped ResourceFlavors and WorkloadPriorityClasses."""
    bindings = yaml.safe_load(cluster.kubectl("get", "clusterrolebindings", "-o", "yaml").stdout)[
        "items"
    ]
    ours = [
        b for b in bindings
        if any(s.get("name") == install.release and s.get("namespace") == install.system
               for s in b.get("subjects") or [])
    ]  # fmt: skip
    assert [b["roleRef"]["name"] for b in ours] == [f"{install.release}-nodes"]
    role = yaml.safe_load(
        cluster.kubectl("get", "clusterrole", f"{install.release}-nodes", "-o", "yaml").stdout
    )
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]},
        {
            "apiGroups": ["kueue.x-k8s.io"],
            "resources": ["resourceflavors", "workloadpriorityclasses"],
            "verbs": ["list", "watch"],
        },
    ]


def test_the_operator_pod_is_admitted_by_a_restricted_namespace(
    cluster: Cluster, install: Install, tmp_path: Path
) -> None:
    """The same pod template, server-side dry-run into a namespace that enforces
    `restricted`: the API server's own Pod Security admission judges it."""
    strict = f"strict-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", strict)
    try:
        cluster.kubectl(
            "label", "namespace", strict, "pod-security.kubernetes.io/enforce=restricted"
        )
        deployment = yaml.safe_load(
            cluster.kubectl(
                "get", "deployment", install.release, "-n", install.system, "-o", "yaml"
            ).stdout
        )
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "operator-dry-run", "namespace": strict},
            "spec": {**deployment["spec"]["template"]["spec"], "serviceAccountName": "default"},
        }
        manifest = tmp_path / "pod.yaml"
        manifest.write_text(yaml.safe_dump(pod))
        proc = cluster.kubectl("create", "--dry-run=server", "-f", str(manifest), check=False)
        assert proc.returncode == 0, proc.stderr
        assert "would violate" not in proc.stderr, proc.stderr
    finally:
        cluster.kubectl("delete", "namespace", strict, "--wait=false", check=False)


def test_kubelet_leases_are_watched_with_only_the_kube_node_lease_role(
    cluster: Cluster, install: Install
) -> None:
    """The operator's kubelet-Lease watch (kubelet_leases.py), as the operator's account:
    its list and watch of kube-node-lease alone see every node's kubelet, renewals
    included, with no cluster-wide Lease right."""
    from ctj_operator.kubelet_leases import KubeletLeaseWatch, WatchConfig
    from ctj_operator.observe import Freshness
    from kubernetes import client

    api = cluster.api_client()
    api.set_default_header("Impersonate-User", install.account)
    kubelets = Freshness()
    watch = KubeletLeaseWatch(client.CoordinationV1Api(api), kubelets, WatchConfig(timeout_s=5))
    nodes = cluster.kubectl("get", "nodes", "-o", "jsonpath={.items[*].metadata.name}").stdout
    watch.start()
    try:
        assert watch.listed.wait(30), "the first list of kube-node-lease"
        first = {n: kubelets.changed_at(n) for n in nodes.split()}
        assert all(first.values()), first
        # kubelets renew every few seconds: the watch (and its re-lists) see each renewal
        wait_until(
            lambda: all((kubelets.changed_at(n) or 0) > t for n, t in first.items() if t),
            timeout=60,
            what="a renewal of every kubelet's Lease, seen by the watch",
        )
    finally:
        watch.stop()


@pytest.mark.parametrize("backend", ["pods", "pytorchjob"])
def test_the_example_job_s_rank_pods_are_admitted_by_a_restricted_namespace(
    cluster: Cluster, tmp_path: Path, backend: str
) -> None:
    """examples/job.yaml's rank pods as the operator builds them (its sidecar, volumes and
    the example's restricted template), server-side dry-run into a namespace that
    enforces `restricted`: the API server's Pod Security admission, not our rule list."""
    from ctj_operator import builders
    from ctj_operator.spec import JobSpec

    from tests.conftest import ROOT

    strict = f"strict-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", strict)
    try:
        cluster.kubectl(
            "label", "namespace", strict, "pod-security.kubernetes.io/enforce=restricted"
        )
        example = yaml.safe_load((Path(ROOT) / "examples" / "job.yaml").read_text())
        spec = JobSpec.parse({**example["spec"], "backend": backend})
        body = {"metadata": {"name": "demo", "namespace": strict, "uid": "u-1"}}
        uri = f"s3://bucket/jobs/{strict}/demo-u-1"
        if backend == "pods":
            pod_specs = [
                builders.build_pod(body, spec, uri=uri, attempt=1, world_size=2, node_rank=r)[
                    "spec"
                ]
                for r in range(2)
            ]
        else:
            job = builders.build_pytorchjob(body, spec, uri=uri, attempt=1, world_size=2)
            pod_specs = [r["template"]["spec"] for r in job["spec"]["pytorchReplicaSpecs"].values()]
        for i, pod_spec in enumerate(pod_specs):
            meta = {"name": f"rank-{i}", "namespace": strict}
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}
            manifest = tmp_path / f"rank-{i}.yaml"
            manifest.write_text(yaml.safe_dump(pod))
            proc = cluster.kubectl("create", "--dry-run=server", "-f", str(manifest), check=False)
            assert proc.returncode == 0, proc.stderr
            assert "would violate" not in proc.stderr, proc.stderr
    finally:
        cluster.kubectl("delete", "namespace", strict, "--wait=false", check=False)
