"""The control plane is real: nodes, versions, RBAC answers and CRDs behave as on a cluster."""

from __future__ import annotations

import json

import pytest
from ctj_devcluster import Cluster

from .conftest import GPU_RESOURCE

pytestmark = pytest.mark.cluster

CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.test.ctj.dev"},
    "spec": {
        "group": "test.ctj.dev",
        "names": {"kind": "Widget", "plural": "widgets", "singular": "widget"},
        "scope": "Namespaced",
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "x-kubernetes-validations": [
                                    {
                                        "rule": "self.min <= self.max",
                                        "message": "min must be <= max",
                                    }
                                ],
                                "properties": {
                                    "min": {"type": "integer"},
                                    "max": {"type": "integer"},
                                },
                            }
                        },
                    }
                },
            }
        ],
    },
}


def test_nodes_are_ready_with_capacity(cluster: Cluster) -> None:
    nodes = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["node-1", "node-2"]
    for node in nodes:
        ready = {c["type"]: c["status"] for c in node["status"]["conditions"]}["Ready"]
        assert ready == "True"
        assert node["status"]["capacity"][GPU_RESOURCE] == "2"
        assert node["status"]["allocatable"]["cpu"] == "4"
        assert node["status"]["addresses"][0]["address"].startswith("127.")
    table = cluster.kubectl("get", "nodes").stdout
    assert table.count(" Ready ") == 2, table


def test_server_reports_its_real_version(cluster: Cluster) -> None:
    version = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert version["serverVersion"]["gitVersion"] == version["clientVersion"]["gitVersion"]
    assert version["serverVersion"]["gitVersion"].startswith("v1.34.")


def test_rbac_answers_can_i(cluster: Cluster, namespace: str) -> None:
    sa = f"system:serviceaccount:{namespace}:default"

    def can_i(*args: str) -> str:
        return cluster.kubectl("auth", "can-i", *args, check=False).stdout.strip()

    assert can_i("create", "pods", "-n", namespace) == "yes"  # the admin
    assert can_i("create", "pods", "-n", namespace, f"--as={sa}") == "no"
    cluster.kubectl(
        "create",
        "rolebinding",
        "edit",
        "--clusterrole=edit",
        f"--serviceaccount={namespace}:default",
        "-n",
        namespace,
    )
    assert can_i("create", "pods", "-n", namespace, f"--as={sa}") == "yes"
    assert can_i("create", "pods", "-n", "default", f"--as={sa}") == "no"
    # A node may only read what its own pods use (the Node authorizer).
    answer = can_i("list", "secrets", "-A", "--as=system:node:node-1", "--as-group=system:nodes")
    assert answer.startswith("no - can only read namespaced object"), answer


def test_crd_is_applied_served_and_validated(cluster: Cluster, namespace: str) -> None:
    cluster.kubectl("apply", "-f", "-", input=json.dumps(CRD))
    cluster.wait_crd_established("widgets.test.ctj.dev", timeout=30)
    good = {
        "apiVersion": "test.ctj.dev/v1",
        "kind": "Widget",
        "metadata": {"name": "ok", "namespace": namespace},
        "spec": {"min": 1, "max": 2},
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(good))
    got = json.loads(cluster.kubectl("get", "widget", "ok", "-n", namespace, "-o", "json").stdout)
    assert got["spec"] == {"min": 1, "max": 2}
    bad = {
        **good,
        "metadata": {"name": "bad", "namespace": namespace},
        "spec": {"min": 3, "max": 2},
    }
    result = cluster.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert result.returncode != 0
    assert "min must be <= max" in result.stderr
