"""Is a cluster fit to run the e2e tier? Asked first, so a broken cluster fails the tier in
a minute with its reason instead of after every scenario's timeouts.

Two checks, each naming what is wrong: every kube-system pod runs, Ready, and none is
crash-looping (kube-proxy that cannot start is the classic: kind nodes out of inotify
instances); and from a pod on every Ready node, the cluster's DNS resolves the API's
Service and the API's Service address answers a TCP connection (kube-proxy's rules).
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

PROBE_NAMESPACE = "ctj-health"
API_NAME = "kubernetes.default.svc.cluster.local"
# Runs in our trainer image (it has Python): exits 1 with what failed, one line.
PROBE = f"""
import os, socket, sys
bad = []
try:
    socket.getaddrinfo("{API_NAME}", 443)
except OSError as exc:
    bad.append(f"DNS: {API_NAME}: {{exc}}")
host = os.environ.get("KUBERNETES_SERVICE_HOST", "")
try:
    socket.create_connection((host, 443), timeout=5).close()
except OSError as exc:
    bad.append(f"the API's Service {{host}}:443: {{exc}}")
print("; ".join(bad) or "ok", flush=True)
sys.exit(1 if bad else 0)
"""


def system_pod_problems(core: client.CoreV1Api) -> list[str]:
    """kube-system pods that are not running Ready, each with the reason its containers give."""
    problems = []
    for pod in core.list_namespaced_pod("kube-system").items:
        where = f"kube-system/{pod.metadata.name} on {pod.spec.node_name or 'no node'}"
        if pod.status.phase == "Succeeded":
            continue
        ready = any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])
        if pod.status.phase == "Running" and ready:
            continue
        reasons = [_container_reason(s) for s in pod.status.container_statuses or [] if not s.ready]
        why = "; ".join(r for r in reasons if r) or f"phase {pod.status.phase}, not Ready"
        problems.append(f"{where}: {why}")
    return problems


def _container_reason(status: Any) -> str:
    waiting = status.state.waiting if status.state else None
    last = status.last_state.terminated if status.last_state else None
    reason = waiting.reason if waiting else "not ready"
    detail = (last.message or last.reason or "").strip() if last else ""
    if waiting and waiting.message:
        detail = detail or waiting.message.strip()
    text = f"{status.name}: {reason} (restarts {status.restart_count})"
    return f"{text}: {detail.splitlines()[-1][:200]}" if detail else text


def network_problems(
    core: client.CoreV1Api, image: str, *, timeout_s: float = 120.0, log: Callable[[str], None]
) -> list[str]:
    """Runs the probe on every Ready node at once; what failed, per node."""
    nodes = [n.metadata.name for n in core.list_node().items if _ready(n)]
    if not nodes:
        return ["no node is Ready"]
    _ensure_namespace(core)
    run = secrets.token_hex(3)
    pods = {node: f"probe-{run}-{i}" for i, node in enumerate(nodes)}
    try:
        for node, name in pods.items():
            core.create_namespaced_pod(PROBE_NAMESPACE, _probe_pod(name, node, image))
        log(f"health: DNS and the API's Service from a pod on each of {len(nodes)} nodes")
        return _probe_results(core, pods, timeout_s)
    finally:
        for name in pods.values():
            try:
                core.delete_namespaced_pod(name, PROBE_NAMESPACE, grace_period_seconds=0)
            except ApiException as exc:
                if exc.status != 404:
                    raise


def _probe_results(core: client.CoreV1Api, pods: dict[str, str], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    done: dict[str, str] = {}
    while len(done) < len(pods):
        for node, name in pods.items():
            if node in done:
                continue
            phase = core.read_namespaced_pod(name, PROBE_NAMESPACE).status.phase
            if phase in ("Succeeded", "Failed"):
                done[node] = phase
        if len(done) < len(pods) and time.monotonic() > deadline:
            for node in set(pods) - set(done):
                done[node] = "timeout"
        elif len(done) < len(pods):
            time.sleep(1.0)
    problems = []
    for node, phase in sorted(done.items()):
        if phase == "Succeeded":
            continue
        if phase == "timeout":
            pod = core.read_namespaced_pod(pods[node], PROBE_NAMESPACE)
            problems.append(
                f"node {node}: the probe pod did not finish in {timeout_s:.0f}s "
                f"(phase {pod.status.phase})"
            )
            continue
        said = core.read_namespaced_pod_log(pods[node], PROBE_NAMESPACE).strip()
        problems.append(f"node {node}: {said or 'the probe failed without a word'}")
    return problems


def _ready(node: Any) -> bool:
    conditions = node.status.conditions or []
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def _ensure_namespace(core: client.CoreV1Api) -> None:
    try:
        core.create_namespace({"metadata": {"name": PROBE_NAMESPACE}})
    except ApiException as exc:
        if exc.status != 409:
            raise


def _probe_pod(name: str, node: str, image: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "ctj-health"}},
        "spec": {
            "nodeName": node,  # every node, the control plane's included
            "restartPolicy": "Never",
            "tolerations": [{"operator": "Exists"}],
            "automountServiceAccountToken": False,
            "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", PROBE],
                    "securityContext": {
                        "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"]},
                    },
                }
            ],
        },
    }


def cluster_problems(
    core: client.CoreV1Api,
    image: str,
    log: Callable[[str], None],
    *,
    settle_s: float = 60.0,
) -> list[str]:
    """Everything that keeps the cluster from running the tier; empty when it is fit. The
    system pods get ``settle_s`` to be Ready (a cluster just made may still be starting
    one); a problem that outlasts it is reported."""
    deadline = time.monotonic() + settle_s
    while (problems := system_pod_problems(core)) and time.monotonic() < deadline:
        time.sleep(2.0)
    if problems:
        return problems
    return network_problems(core, image, log=log)
