"""A job's NetworkPolicy, enforced on a real cluster: with the job's two ranks running,
a pod outside the job (in another namespace, or unlabelled beside it) cannot connect to a
rank's peer-cache port, the job's own pods still can, and the metrics port answers the
operator and Prometheus. On kind the enforcer is kube-network-policies (hack/kind/network-
policies, installed by hack/kind/cluster.sh); elsewhere the cluster's network plugin must
enforce policies (the test fails where none does: the stranger gets in).

Connections are real: a probe pod (the sidecar image, restricted Pod Security) runs
Python's socket.create_connection with a timeout, through `kubectl exec`.

The policy is the operator's (``<job>-ctj``, made with the attempt, before its pods):
the control takes it away for a moment (a stranger then gets in: the ports are served
and the network carries the connection), and puts the same object back.
"""

from __future__ import annotations

import json
import secrets
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from ctj_operator.builders import CACHE_PORT, METRICS_PORT, SIDECAR_NAME
from ctj_operator.network_policy import (
    NetworkPolicyParams,
    build_network_policy,
    network_policy_name,
)
from ctj_stack import Stack
from ctj_stack.scenario import NO_STANDBY
from ctj_stack.stack import OPERATOR_NAMESPACE

JOB = "netpol"
CONNECT_TIMEOUT_S = 3.0
ENFORCED_WITHIN_S = 90.0
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}
# exit 0: connected (and, with a path, an HTTP 200); 1: refused, timed out, any error
PROBE = """
import socket, sys, urllib.request
host, port, timeout = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
path = sys.argv[4] if len(sys.argv) > 4 else ""
try:
    if path:
        with urllib.request.urlopen(f"http://{host}:{port}{path}", timeout=timeout) as r:
            sys.exit(0 if r.status == 200 else 1)
    socket.create_connection((host, port), timeout=timeout).close()
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(1)
"""
RESTRICTED = {
    "runAsNonRoot": True,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _probe_pod(stack: Stack, namespace: str, name: str, labels: dict[str, str]) -> dict[str, Any]:
    image = stack.images.sidecar or stack.images.trainer
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "probe",
                    "image": image,
                    "imagePullPolicy": "IfNotPresent",
                    "command": ["python", "-c", "import time; time.sleep(1e9)"],
                    "securityContext": RESTRICTED,
                    "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
                }
            ],
        },
    }


def connects(
    stack: Stack,
    namespace: str,
    pod: str,
    host: str,
    port: int,
    *,
    container: str | None = None,
    path: str = "",
) -> bool:
    """Whether ``pod`` opens a TCP connection to host:port (an HTTP 200 on ``path``)."""
    argv = [stack.tools.kubectl, "--kubeconfig", str(stack.kubeconfig), "-n", namespace,
            "exec", pod]  # fmt: skip
    if container:
        argv += ["-c", container]
    argv += ["--", "python", "-c", PROBE, host, str(port), str(CONNECT_TIMEOUT_S)]
    if path:
        argv.append(path)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"kubectl exec {pod} failed ({proc.returncode}): {proc.stderr}")
    stack.log(f"  {namespace}/{pod} -> {host}:{port}{path}: "
              f"{'connected' if proc.returncode == 0 else proc.stdout.strip()}")  # fmt: skip
    return proc.returncode == 0


def the_jobs_policy(stack: Stack, namespace: str) -> dict[str, Any]:
    """The policy the operator made for the job, as the API server holds it: owned by the
    job, and what ctj_operator.network_policy builds for it."""
    found = json.loads(stack.kubectl("-n", namespace, "get", "networkpolicy",
                                     network_policy_name(JOB), "-o", "json"))  # fmt: skip
    (owner,) = found["metadata"]["ownerReferences"]
    assert (owner["kind"], owner["name"]) == ("CheckpointedTrainingJob", JOB)
    built = build_network_policy(
        stack.job(namespace, JOB), NetworkPolicyParams(operator_namespace=OPERATOR_NAMESPACE)
    )
    assert found["spec"]["podSelector"] == built["spec"]["podSelector"]
    assert len(found["spec"]["ingress"]) == len(built["spec"]["ingress"])
    return {
        "apiVersion": found["apiVersion"],
        "kind": found["kind"],
        "metadata": {k: found["metadata"][k] for k in ("name", "labels", "ownerReferences")
                     if k in found["metadata"]},
        "spec": found["spec"],
    }  # fmt: skip


@pytest.fixture(scope="module")
def outside(stack: Stack) -> Iterator[str]:
    namespace = f"ctj-e2e-outside-{secrets.token_hex(3)}"
    stack.apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}])
    yield namespace
    stack.kubectl("delete", "namespace", namespace, "--wait=false")


@pytest.fixture(scope="module")
def ranks(stack: Stack, operator_installed: str, job_namespace: str) -> list[Any]:
    """The job's two rank pods, Running (their sidecars serve both ports)."""
    job = stack.example_job(JOB, CTJ_TOTAL_STEPS="1000000", **NO_STANDBY)
    job["spec"].update({"replicas": 2, "minReplicas": 1, "maxReplicas": 2})
    stack.apply_job(job_namespace, job)
    status = stack.wait_running(job_namespace, JOB, world=2, after=-1)
    pods = stack.attempt_pods(job_namespace, JOB, int(status["attempt"]))
    return sorted(pods, key=lambda p: p.metadata.name)


@pytest.fixture(scope="module")
def probes(stack: Stack, outside: str, job_namespace: str, ranks: list[Any]) -> dict[str, str]:
    """Pods that are not the job's, ready: name -> namespace."""
    wanted = {
        "stranger": (outside, {}),
        "prometheus": (outside, PROMETHEUS_LABELS),
        "neighbour": (job_namespace, {}),
    }
    stack.apply([_probe_pod(stack, ns, name, labels) for name, (ns, labels) in wanted.items()])
    for name, (ns, _) in wanted.items():
        stack.kubectl("-n", ns, "wait", f"pod/{name}", "--for=condition=Ready", "--timeout=120s")
    return {name: ns for name, (ns, _) in wanted.items()}


@pytest.mark.incremental
class TestNetworkPolicy:
    state: dict[str, Any] = {}

    def test_without_the_jobs_policy_anyone_reaches_a_rank(
        self, stack: Stack, job_namespace: str, ranks: list[Any], probes: dict[str, str]
    ) -> None:
        # the control: the operator's policy taken away, the ports are served and the
        # network carries the connection, so a refusal later is the policy's
        self.state["policy"] = the_jobs_policy(stack, job_namespace)
        stack.kubectl("-n", job_namespace, "delete", "networkpolicy", network_policy_name(JOB))
        rank = ranks[0].status.pod_ip
        stack.wait(
            lambda: connects(stack, probes["stranger"], "stranger", rank, CACHE_PORT),
            "the policy gone (a stranger's connection accepted)",
            ENFORCED_WITHIN_S,
        )
        assert connects(stack, probes["neighbour"], "neighbour", rank, METRICS_PORT)

    def test_with_the_policy_a_pod_outside_the_job_cannot_connect(
        self, stack: Stack, job_namespace: str, ranks: list[Any], probes: dict[str, str]
    ) -> None:
        stack.apply([self.state["policy"]], job_namespace)  # the operator's, put back
        rank = ranks[0].status.pod_ip
        stack.wait(
            lambda: not connects(stack, probes["stranger"], "stranger", rank, CACHE_PORT),
            "the policy enforced (a stranger's connection refused)",
            ENFORCED_WITHIN_S,
        )
        for other in ranks:
            ip = other.status.pod_ip
            assert not connects(stack, probes["stranger"], "stranger", ip, CACHE_PORT)
            assert not connects(stack, probes["neighbour"], "neighbour", ip, CACHE_PORT)
            assert not connects(stack, probes["stranger"], "stranger", ip, METRICS_PORT)
            # Prometheus reaches the metrics, not the cache
            assert not connects(stack, probes["prometheus"], "prometheus", ip, CACHE_PORT)

    def test_the_jobs_own_pods_still_reach_each_others_peer_cache(
        self, stack: Stack, job_namespace: str, ranks: list[Any]
    ) -> None:
        first, second = ranks
        assert connects(stack, job_namespace, second.metadata.name, first.status.pod_ip,
                        CACHE_PORT, container=SIDECAR_NAME)  # fmt: skip
        assert connects(stack, job_namespace, first.metadata.name, second.status.pod_ip,
                        CACHE_PORT, container=SIDECAR_NAME)  # fmt: skip

    def test_the_metrics_port_answers_prometheus_and_the_operator(
        self, stack: Stack, ranks: list[Any], probes: dict[str, str]
    ) -> None:
        operator = stack.core.list_namespaced_pod(
            OPERATOR_NAMESPACE, label_selector="app.kubernetes.io/component=operator"
        ).items[0]
        for rank in ranks:
            ip = rank.status.pod_ip
            assert connects(stack, probes["prometheus"], "prometheus", ip, METRICS_PORT,
                            path="/metrics")  # fmt: skip
            assert connects(stack, OPERATOR_NAMESPACE, operator.metadata.name, ip,
                            METRICS_PORT, container="operator", path="/metrics")  # fmt: skip

    def test_the_ranks_stay_ready_under_the_policy(
        self, stack: Stack, job_namespace: str, ranks: list[Any]
    ) -> None:
        # the kubelet's probes come from the node: the policy must not starve them
        for rank in ranks:
            pod = stack.core.read_namespaced_pod(rank.metadata.name, job_namespace)
            assert pod.status.phase == "Running"
            ready = {c.name: c.ready for c in pod.status.init_container_statuses or []}
            assert ready.get(SIDECAR_NAME) is True, pod.status
