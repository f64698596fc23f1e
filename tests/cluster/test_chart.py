"""charts/ctj with the real helm: lint, render, and install into the real control plane.

Rendering needs only the helm binary (built from its Go module; the tests skip, with
the build command, where it is missing). The install test uses the session cluster:
the operator pod is created (so the ServiceAccount, the pod spec and the restricted Pod
Security Standard are all accepted by the API server) but pinned to no node, because
the simulated nodes would run its command on this host.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until

from tests.unit.chart_helm import CHART, ROOT, Helm, helm, render, the
from tests.unit.test_chart_files import DASHBOARD, undefined_series

__all__ = ["helm"]  # the fixture, used by name

pytestmark = pytest.mark.cluster

CRD_NAME = "checkpointedtrainingjobs.training.ctj.dev"


def test_helm_lint_passes(helm: Helm) -> None:
    helm("lint", "--strict", str(CHART))
    helm(
        "lint",
        "--strict",
        str(CHART),
        "--set",
        "serviceMonitor.enabled=true,podMonitor.enabled=true,prometheusRule.enabled=true,"
        "grafanaDashboard.enabled=false",
    )


def test_defaults_render_the_operator_and_no_service_monitor(helm: Helm) -> None:
    objects = render(helm)
    kinds = sorted(k for k, _ in objects)
    assert kinds == [
        "CSIDriver",  # the node agents' (nodeCache.mount): a job's node cache, mounted
        "ClusterRole",  # the operator's, where jobs run
        "ClusterRole",  # users': aggregated into edit/admin
        "ClusterRole",  # the node agents': list jobs (to drop a deleted job's cache)
        "ClusterRole",  # the operator's: list/watch Nodes
        "ClusterRole",  # users': aggregated into view
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "ClusterRoleBinding",
        "ConfigMap",
        "DaemonSet",  # the node agents: the node tier of the chunk cache
        "Deployment",
        "NetworkPolicy",  # who reaches the node agents
        "NetworkPolicy",  # who reaches the operator
        "PodDisruptionBudget",
        "Role",  # reading kubelet Leases in kube-node-lease
        "Role",  # its leader Lease, in its own namespace
        "RoleBinding",
        "RoleBinding",
        "Secret",  # the cluster key jobs' tokens derive from (operator and agents)
        "Service",
        "ServiceAccount",
        "ServiceAccount",  # the node agents'
    ]
    # release "ctj-operator" gives deploy/operator-rbac.yaml's names
    assert ("ServiceAccount", "ctj-operator") in objects
    deployment = the(objects, "Deployment")
    assert deployment["metadata"]["namespace"] == "ctj-system"
    assert deployment["spec"]["replicas"] == 2  # a leader and a standby
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ctj-operator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/ctj/operator:0.1.0"
    assert "command" not in container  # the image's ENTRYPOINT: python -m ctj_operator
    assert container["args"][:4] == [
        "--metrics-port=8080",
        "--liveness-port=8081",
        "--watch-timeout=60",
        "--reconcile-interval=0.5",
    ]
    # who may scrape the jobs' metrics ports, through each job's NetworkPolicy
    (peer,) = container["args"][4:]
    assert json.loads(peer.removeprefix("--prometheus-peer=")) == {
        "namespaceSelector": {},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"metrics": 8080, "liveness": 8081}
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and ports[probe["port"]] == 8081
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CTJ_SIDECAR_IMAGE"] == "ghcr.io/ctj/sidecar:0.1.0"
    assert env["CTJ_JOB_KEY_FILE"] == "/etc/ctj/key/key"  # the cluster key, from its Secret
    assert env["CTJ_NODE_CACHE_DRIVER"] == "node-cache.ctj.dev"  # trainers mount their cache
    driver = the(objects, "CSIDriver")["spec"]
    assert driver == {"attachRequired": False, "podInfoOnMount": True,
                      "volumeLifecycleModes": ["Ephemeral"], "fsGroupPolicy": "None"}  # fmt: skip
    service = the(objects, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 8080, "targetPort": "metrics", "protocol": "TCP"}
    ]
    assert (
        service["spec"]["selector"].items()
        <= deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    # the operator never touches S3: no cloud identity on its ServiceAccount
    assert "annotations" not in objects["ServiceAccount", "ctj-operator"]["metadata"]
    (subject,) = objects["ClusterRoleBinding", "ctj-operator"]["subjects"]
    assert subject == {"kind": "ServiceAccount", "name": "ctj-operator", "namespace": "ctj-system"}


def test_values_reach_the_operator(helm: Helm) -> None:
    objects = render(
        helm,
        "image.tag=dev,sidecarImage.repository=registry.local/trainer,sidecarImage.tag=t1",
        "operator.watchNamespaces={team-a,team-b},operator.reconcileIntervalSeconds=2",
    )
    (container,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == "ghcr.io/ctj/operator:dev"
    assert container["args"][3:6] == [
        "--reconcile-interval=2",
        "--namespace=team-a",
        "--namespace=team-b",
    ]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["CTJ_SIDECAR_IMAGE"] == "registry.local/trainer:t1"


def test_service_monitor_only_when_enabled(helm: Helm) -> None:
    assert not any(k in ("ServiceMonitor", "PodMonitor") for k, _ in render(helm))
    objects = render(helm, "serviceMonitor.enabled=true")
    monitor = the(objects, "ServiceMonitor")
    assert not any(k == "PodMonitor" for k, _ in objects)
    assert monitor["spec"]["selector"]["matchLabels"] == the(objects, "Service")["spec"]["selector"]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["honorLabels"] is True
    pods = the(render(helm, "podMonitor.enabled=true"), "PodMonitor")
    assert pods["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"


def test_prometheus_rule_only_when_enabled_and_it_is_the_rules_file(helm: Helm) -> None:
    assert not any(k == "PrometheusRule" for k, _ in render(helm))
    objects = render(helm, "prometheusRule.enabled=true,prometheusRule.labels.release=kps")
    rule = the(objects, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load((CHART / "rules" / "ctj-alerts.yaml").read_text())


def test_schema_rejects_bad_values(helm: Helm) -> None:
    for bad in ("replicaCount=-1", "image.pullPolicy=Sometimes", "imageTag=typo",
                "operator.reconcileIntervalSeconds=0"):  # fmt: skip
        proc = helm("template", "x", str(CHART), "--set", bad, check=False)
        assert proc.returncode != 0, f"--set {bad} rendered"
        assert "values don't meet the specifications of the schema" in proc.stderr


def test_cluster_role_rules_are_deploy_operator_rbac(helm: Helm) -> None:
    reference = [
        d for d in yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text()) if d
    ]
    rendered = render(helm)
    for expected in reference:
        ours = rendered[expected["kind"], expected["metadata"]["name"]]
        assert ours["metadata"].get("namespace") == expected["metadata"].get("namespace")
        for field in ("rules", "roleRef", "subjects"):
            assert ours.get(field) == expected.get(field), (expected["metadata"]["name"], field)
    without = render(helm, "rbac.create=false")
    # what stays are the users' roles (rbac.aggregateToDefaultRoles), none bound to the operator
    assert not any(k in ("ClusterRoleBinding", "Role", "RoleBinding") for k, _ in without)
    assert ("ClusterRole", "ctj-operator") not in without


def test_dashboard_config_map(helm: Helm) -> None:
    config_map = the(render(helm), "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["ctj.json"])
    assert dashboard == json.loads(DASHBOARD.read_text())
    assert undefined_series(dashboard) == set()
    assert not any(k == "ConfigMap" for k, _ in render(helm, "grafanaDashboard.enabled=false"))


def _crd_served(cluster: Cluster) -> bool:
    crd = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    established = any(
        c["type"] == "Established" and c["status"] == "True"
        for c in crd.get("status", {}).get("conditions", [])
    )
    # served: the API answers for the resource (discovery included)
    return established and cluster.kubectl("get", "ctj", "-A", check=False).returncode == 0


def test_helm_install_into_the_cluster(cluster: Cluster, tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:6]
    namespace, release = f"ctj-system-{suffix}", f"ctj-{suffix}"
    crd_existed = cluster.kubectl("get", "crd", CRD_NAME, check=False).returncode == 0
    # the restricted Pod Security Standard: the API server rejects a pod that breaks it
    cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl(
        "label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted"
    )
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"nodeSelector": {"ctj.dev/test-no-such-node": "true"}}))
    editor, viewer = f"ctj-test-editor-{suffix}", f"ctj-test-viewer-{suffix}"
    try:
        # users bound to Kubernetes' own roles, as a cluster's admins bind them
        cluster.kubectl("create", "rolebinding", "editor", "--clusterrole=edit",
                        f"--user={editor}", "-n", namespace)  # fmt: skip
        cluster.kubectl("create", "rolebinding", "viewer", "--clusterrole=view",
                        f"--user={viewer}", "-n", namespace)  # fmt: skip
        installed = cluster.helm("install", release, str(CHART), "-n", namespace, "-f", str(values))
        # NOTES, as helm prints them: the objects they name are the ones just made
        assert "NOTES:" in installed.stdout
        assert f"port-forward svc/{release}-metrics 8080" in installed.stdout
        assert f"rollout status deployment/{release}" in installed.stdout
        releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
        assert [(r["name"], r["status"]) for r in releases] == [(release, "deployed")]
        # helm installs crds/ only when the CRD is absent; either way it must be served
        wait_until(lambda: _crd_served(cluster), timeout=30, what=f"CRD {CRD_NAME} served")

        cluster.kubectl("get", "serviceaccount", release, "-n", namespace)
        cluster.kubectl("get", "clusterrole", release)
        cluster.kubectl("get", "clusterrolebinding", release)
        cluster.kubectl("get", "service", f"{release}-metrics", "-n", namespace)
        cluster.kubectl("get", "configmap", f"{release}-dashboard", "-n", namespace)
        pdb = json.loads(
            cluster.kubectl("get", "pdb", release, "-n", namespace, "-o", "json").stdout
        )
        assert pdb["spec"]["maxUnavailable"] == 1

        def operator_pod() -> dict[str, Any] | None:
            pods = json.loads(
                cluster.kubectl(
                    "get", "pods", "-n", namespace, "-l",
                    f"app.kubernetes.io/instance={release}", "-o", "json",
                ).stdout
            )["items"]  # fmt: skip
            return pods[0] if pods else None

        def events() -> str:
            return cluster.kubectl("get", "events", "-n", namespace, check=False).stdout

        # created by the ReplicaSet: the ServiceAccount exists and the pod is "restricted"
        pod: Any = wait_until(operator_pod, timeout=30, what="the operator pod", on_timeout=events)
        assert pod["spec"]["serviceAccountName"] == release
        wait_until(
            lambda: any(
                c["type"] == "PodScheduled" and c["reason"] == "Unschedulable"
                for c in (operator_pod() or {}).get("status", {}).get("conditions", [])
            ),
            timeout=30,
            what="the operator pod pinned to no node",
        )

        # the binding gives the operator's ServiceAccount its rules, and nothing more
        who = f"system:serviceaccount:{namespace}:{release}"
        for verb, resource, allowed in [
            ("list", "nodes", "yes"),
            ("create", "pods", "yes"),
            ("patch", "checkpointedtrainingjobs.training.ctj.dev/status", "yes"),
            ("delete", "nodes", "no"),
            ("list", "secrets", "no"),
        ]:
            answer = cluster.kubectl("auth", "can-i", verb, resource, "--as", who, check=False)
            assert answer.stdout.strip() == allowed, f"{who} {verb} {resource}"

        # users: Kubernetes' aggregation controller copies our roles into edit and view
        def can(user: str, verb: str, resource: str, sub: str = "") -> str:
            args = ["auth", "can-i", verb, resource, "--as", user, "-n", namespace]
            args += [f"--subresource={sub}"] if sub else []
            return cluster.kubectl(*args, check=False).stdout.strip()

        ctj = CRD_NAME
        wait_until(lambda: can(editor, "create", ctj) == "yes", timeout=30,
                   what="edit aggregates the chart's edit role")  # fmt: skip
        wait_until(lambda: can(viewer, "list", ctj) == "yes", timeout=30,
                   what="view aggregates the chart's view role")  # fmt: skip
        for user, verb, resource, sub, allowed in [
            (editor, "update", ctj, "", "yes"),
            (editor, "delete", ctj, "", "yes"),
            (editor, "update", ctj, "scale", "yes"),  # kubectl scale ctj/NAME
            (editor, "get", ctj, "", "yes"),  # edit includes view's rules
            (editor, "patch", ctj, "status", "no"),  # the operator's alone
            (viewer, "get", ctj, "", "yes"),
            (viewer, "watch", ctj, "", "yes"),
            (viewer, "create", ctj, "", "no"),
            (viewer, "delete", ctj, "", "no"),
            (viewer, "update", ctj, "scale", "no"),
        ]:
            assert can(user, verb, resource, sub) == allowed, f"{user} {verb} {resource} {sub}"

        cluster.helm("uninstall", release, "-n", namespace, "--wait", "--timeout=60s")
        assert cluster.kubectl("get", "clusterrole", release, check=False).returncode != 0
        # it was the chart's roles that gave edit and view these rights
        wait_until(lambda: can(editor, "create", ctj) == "no", timeout=30,
                   what="edit without the chart's role")  # fmt: skip
        wait_until(lambda: can(viewer, "list", ctj) == "no", timeout=30,
                   what="view without the chart's role")  # fmt: skip
        assert cluster.kubectl(
            "get", "deployment", release, "-n", namespace, check=False
        ).returncode
        # helm never deletes CRDs it installed (that would delete every job)
        cluster.kubectl("get", "crd", CRD_NAME)
    finally:
        cluster.helm("uninstall", release, "-n", namespace, check=False)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)
        if not crd_existed:  # leave the session cluster as we found it
            cluster.kubectl("delete", "crd", CRD_NAME, "--timeout=60s", check=False)
