"""The e2e tier's first question, asked of a real API server and real pods: which system
pods keep the cluster from running it, and why (ctj_stack.health)."""

from __future__ import annotations

import uuid

from ctj_devcluster import Cluster
from ctj_devcluster.processes import wait_until
from ctj_stack.health import system_pod_problems
from kubernetes import client


def test_a_crash_looping_system_pod_is_named_with_its_node_and_reason(cluster: Cluster) -> None:
    core = client.CoreV1Api(cluster.api_client())
    name = f"kube-proxy-{uuid.uuid4().hex[:5]}"
    core.create_namespaced_pod(
        "kube-system",
        {
            "metadata": {"name": name},
            "spec": {
                "restartPolicy": "Always",
                "containers": [
                    {
                        "name": "kube-proxy",
                        "image": "kube-proxy:test",
                        "command": ["sh", "-c", "echo 'too many open files' >&2; exit 1"],
                    }
                ],
            },
        },
    )
    try:

        def reported() -> str | None:
            mine = [p for p in system_pod_problems(core) if f"kube-system/{name} " in p]
            return next((p for p in mine if "CrashLoopBackOff" in p), None)

        problem = wait_until(reported, timeout=60, what=f"{name} reported crash-looping")
        node = core.read_namespaced_pod(name, "kube-system").spec.node_name
        assert f"kube-system/{name} on {node}: kube-proxy: CrashLoopBackOff" in str(problem)
    finally:
        core.delete_namespaced_pod(name, "kube-system", grace_period_seconds=0)
    wait_until(
        lambda: not any(f"/{name} " in p for p in system_pod_problems(core)),
        timeout=60,
        what=f"{name} gone from the problems",
    )
