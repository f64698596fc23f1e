"""Small helpers the cluster tests share: pod manifests and condition waits."""

from __future__ import annotations

import json
from typing import Any

from ctj_devcluster.processes import wait_until
from kubernetes import client


def core(cluster: Any) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.api_client())


def read_pod(api: client.CoreV1Api, namespace: str, name: str) -> dict[str, Any]:
    return json.loads(api.read_namespaced_pod(name, namespace, _preload_content=False).data)


def python_container(name: str, code: str, **extra: Any) -> dict[str, Any]:
    """A container running ``python -c code``: ``python`` is the node's venv python."""
    return {"name": name, "image": "python:3.11", "command": ["python", "-c", code], **extra}


def pod_manifest(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    labels = spec.pop("labels", {})
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "terminationGracePeriodSeconds": 5,
            "containers": containers,
            **spec,
        },
    }


def wait_pod_phase(
    api: client.CoreV1Api, namespace: str, name: str, phases: set[str], timeout: float = 60
) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        pod = read_pod(api, namespace, name)
        return pod if pod.get("status", {}).get("phase") in phases else None

    def diagnostics() -> str:
        return json.dumps(read_pod(api, namespace, name).get("status"), indent=1)

    result = wait_until(
        done, timeout=timeout, what=f"pod {namespace}/{name} in {phases}", on_timeout=diagnostics
    )
    assert isinstance(result, dict)
    return result


def exit_codes(pod: dict[str, Any]) -> dict[str, int]:
    return {
        s["name"]: s["state"]["terminated"]["exitCode"]
        for s in pod["status"].get("containerStatuses", [])
        if (s.get("state") or {}).get("terminated")
    }


def node_ready(api: client.CoreV1Api, name: str) -> str:
    node = api.read_node(name)
    return next((c.status for c in node.status.conditions or [] if c.type == "Ready"), "Unknown")
