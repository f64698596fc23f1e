"""Nodes fail and are managed as in a real cluster: loss, NotReady, eviction, cordon,
drain and deletion."""

from __future__ import annotations

import os
import time

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until

from .conftest import NODE_GRACE_SECONDS
from .kube import core, node_ready, pod_manifest, python_container, read_pod, wait_pod_phase

pytestmark = pytest.mark.cluster

SLEEPER = (
    "import os, time; open(os.environ['PIDFILE'], 'w').write(str(os.getpid())); time.sleep(3600)"
)


def _sleeper(name: str, node: str, pidfile: str, toleration_seconds: int = 300) -> dict:
    tolerations = [
        {
            "key": f"node.kubernetes.io/{t}",
            "operator": "Exists",
            "effect": "NoExecute",
            "tolerationSeconds": toleration_seconds,
        }
        for t in ("not-ready", "unreachable")
    ]
    return pod_manifest(
        name,
        [python_container("main", SLEEPER, env=[{"name": "PIDFILE", "value": pidfile}])],
        nodeSelector={"kubernetes.io/hostname": node},
        tolerations=tolerations,
    )


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def test_killing_a_node_agent_loses_the_node(cluster: Cluster, namespace: str, tmp_path) -> None:
    api = core(cluster)
    cluster.add_node("doomed")
    pidfile = tmp_path / "pid"
    api.create_namespaced_pod(
        namespace, _sleeper("victim", "doomed", str(pidfile), toleration_seconds=1)
    )
    wait_pod_phase(api, namespace, "victim", {"Running"})
    pid = int(
        wait_until(
            lambda: pidfile.exists() and pidfile.read_text(),
            timeout=30,
            what="the container's pid file",
        )
    )  # type: ignore[arg-type]
    assert _pid_alive(pid)

    killed_at = time.monotonic()
    cluster.kill_node("doomed")
    wait_until(lambda: not _pid_alive(pid), timeout=5, what="the container to die with its node")

    wait_until(
        lambda: node_ready(api, "doomed") == "Unknown",
        timeout=NODE_GRACE_SECONDS + 15,
        what="node doomed NotReady (Unknown)",
    )
    not_ready_after = time.monotonic() - killed_at
    assert not_ready_after < NODE_GRACE_SECONDS + 10, not_ready_after
    wait_until(
        lambda: (
            "node.kubernetes.io/unreachable"
            in {t.key for t in api.read_node("doomed").spec.taints or []}
        ),
        timeout=10,
        what="the unreachable taint on the lost node",
    )

    # taint-based eviction: tolerationSeconds=1, then the pod is marked for deletion
    wait_until(
        lambda: read_pod(api, namespace, "victim")["metadata"].get("deletionTimestamp"),
        timeout=30,
        what="the pod on the lost node to be evicted",
    )
    ready = next(
        c
        for c in read_pod(api, namespace, "victim")["status"]["conditions"]
        if c["type"] == "Ready"
    )
    assert ready["status"] == "False"

    # Deleting the Node: its Lease (owned by the Node) is garbage-collected.
    api.delete_node("doomed")
    from kubernetes import client

    leases = client.CoordinationV1Api(cluster.api_client())
    wait_until(
        lambda: (
            "doomed"
            not in {
                lease.metadata.name
                for lease in leases.list_namespaced_lease("kube-node-lease").items
            }
        ),
        timeout=30,
        what="the lost node's Lease to be garbage-collected",
    )
    api.delete_namespaced_pod("victim", namespace, grace_period_seconds=0)


def test_cordon_then_drain_a_node(cluster: Cluster, namespace: str, tmp_path) -> None:
    api = core(cluster)
    cluster.kubectl("cordon", "node-2")
    try:
        api.create_namespaced_pod(namespace, _sleeper("waits", "node-2", str(tmp_path / "a")))

        def unschedulable() -> bool:
            conds = read_pod(api, namespace, "waits")["status"].get("conditions") or []
            return any(
                c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable" for c in conds
            )

        wait_until(unschedulable, timeout=30, what="the scheduler to refuse the cordoned node")
    finally:
        cluster.kubectl("uncordon", "node-2")
    running = wait_pod_phase(api, namespace, "waits", {"Running"})
    assert running["spec"]["nodeName"] == "node-2"
    pid = int(
        wait_until(
            lambda: (tmp_path / "a").exists() and (tmp_path / "a").read_text(),
            timeout=30,
            what="pid file",
        )
    )  # type: ignore[arg-type]

    # drain evicts through the Eviction API; the agent stops the container (SIGTERM)
    # and removes the pod; the node stays cordoned
    cluster.kubectl(
        "drain",
        "node-2",
        "--force",
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--timeout=60s",
        timeout=90,
    )
    try:
        assert api.read_node("node-2").spec.unschedulable is True
        assert not _pid_alive(pid)
        names = [p.metadata.name for p in api.list_namespaced_pod(namespace).items]
        assert "waits" not in names
    finally:
        cluster.kubectl("uncordon", "node-2")
