"""Nodes fail and are managed as in a real cluster: loss, NotReady, eviction, cordon,
drain and deletion."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until

from .conftest import GPU_RESOURCE, NODE_GRACE_SECONDS
from .kube import core, node_ready, pod_manifest, python_container, read_pod, wait_pod_phase

pytestmark = pytest.mark.cluster

SLEEPER = """
import os, signal, subprocess
grandchild = subprocess.Popen(["sleep", "infinity"])   # like torchrun's workers
with open(os.environ["PIDFILE"] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {grandchild.pid}")
os.rename(os.environ["PIDFILE"] + ".tmp", os.environ["PIDFILE"])
signal.pause()   # until stopped
"""


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


def _pids(pidfile: Path) -> list[int]:
    text = wait_until(
        lambda: pidfile.exists() and pidfile.read_text(), timeout=30, what=f"{pidfile}"
    )
    return [int(p) for p in str(text).split()]


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
    pids = _pids(pidfile)
    assert all(_pid_alive(p) for p in pids)

    killed_at = time.monotonic()
    cluster.kill_node("doomed")
    wait_until(
        lambda: not any(_pid_alive(p) for p in pids),
        timeout=5,
        what="the container and its children to die with their node",
    )

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

    # The machine comes back: Ready again, and it finishes the eviction (nobody else can
    # confirm the containers are gone).
    cluster.restart_node("doomed")
    assert node_ready(api, "doomed") == "True"
    wait_until(
        lambda: "victim" not in [p.metadata.name for p in api.list_namespaced_pod(namespace).items],
        timeout=30,
        what="the evicted pod to be removed by its returning node",
    )

    # Deleting the Node: its Lease (owned by the Node) is garbage-collected.
    cluster.kill_node("doomed")
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
    pids = _pids(tmp_path / "a")

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
        assert not any(_pid_alive(p) for p in pids)
        names = [p.metadata.name for p in api.list_namespaced_pod(namespace).items]
        assert "waits" not in names
    finally:
        cluster.kubectl("uncordon", "node-2")


def test_extended_resources_are_scheduled_like_gpus(cluster: Cluster, namespace: str) -> None:
    api = core(cluster)

    def gpu_pod(name: str, gpus: int) -> dict:
        resources = {"limits": {GPU_RESOURCE: str(gpus)}}
        return pod_manifest(name, [python_container("main", "print('ran')", resources=resources)])

    api.create_namespaced_pod(namespace, gpu_pod("fits", 2))
    api.create_namespaced_pod(namespace, gpu_pod("too-big", 3))  # nodes have 2 each
    assert wait_pod_phase(api, namespace, "fits", {"Succeeded"})["spec"]["nodeName"]

    def unschedulable() -> bool:
        conds = read_pod(api, namespace, "too-big")["status"].get("conditions") or []
        return any(
            c["type"] == "PodScheduled" and f"Insufficient {GPU_RESOURCE}" in c.get("message", "")
            for c in conds
        )

    wait_until(unschedulable, timeout=30, what="the scheduler to find no node with 3 GPUs")
