"""The demo's closing hints (hack/ctj_stack/demo.py) name only what exists: the Service
and port in the chart as the demo installs it (real helm), and a sidecar port the pods
the operator builds serve, reached in a way that works where the server listens."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ctj_operator import builders
from ctj_operator.spec import JobSpec
from ctj_stack import demo

from tests.unit.chart_helm import Helm, helm, render, the

__all__ = ["helm"]  # the fixture, used by name

HINTS = demo.where_to_look(Path("/tmp/kubeconfig"), Path("/opt/bin"))


def built_pod() -> dict[str, Any]:
    body = {"metadata": {"name": demo.JOB, "namespace": demo.NAMESPACE, "uid": "u-1"}}
    spec = JobSpec.parse(
        {
            "replicas": 3,
            "checkpoint": {"uri": "s3://bucket/jobs", "credentialsSecret": "s3-credentials"},
            "template": {"spec": {"containers": [{"name": "trainer", "image": "t:1"}]}},
        }
    )
    return builders.build_pod(
        body, spec, uri="s3://bucket/jobs/x", attempt=1, world_size=3, node_rank=0
    )


def listens_on_all_addresses(container: dict[str, Any]) -> bool:
    """kubectl port-forward connects to localhost inside the pod: a server bound to the
    pod IP (the sidecar's CTJ_METRICS_HOST from status.podIP) refuses it."""
    for env in container.get("env") or []:
        if env["name"] == builders.Env.METRICS_HOST:
            return env.get("value") in ("", "0.0.0.0", "::")  # valueFrom: one address
    return True


def test_the_operator_service_hint_names_the_installed_service_and_port(helm: Helm) -> None:
    # the demo installs the chart as ctj_stack.stack.install_operator does
    objects = render(helm, release=demo.OPERATOR_RELEASE, namespace=demo.OPERATOR_NAMESPACE)
    forwards = re.findall(r"kubectl -n (\S+) port-forward svc/(\S+) (\d+)", HINTS)
    assert forwards, HINTS
    for namespace, name, port in forwards:
        service = objects.get(("Service", name))
        assert service, f"the hint names svc/{name}; the chart makes {sorted(objects)}"
        assert service["metadata"]["namespace"] == namespace
        (served,) = [p for p in service["spec"]["ports"] if p["port"] == int(port)]
        # the port it forwards to is one the operator container declares and serves on
        # all addresses (prometheus_client's default)
        (container,) = the(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
        names = {p["name"] for p in container["ports"]}
        assert served["targetPort"] in names
        assert listens_on_all_addresses(container)
        assert f"curl localhost:{port}/metrics" in HINTS


def test_the_sidecar_hint_reaches_its_port_through_the_api_server() -> None:
    pod = built_pod()
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == builders.SIDECAR_NAME)
    ports = {p["containerPort"] for p in sidecar["ports"]}
    proxied = re.findall(r"get --raw /api/v1/namespaces/(\S+)/pods/<pod>:(\d+)/proxy/(\S+)", HINTS)
    assert proxied, HINTS
    for namespace, port, path in proxied:
        assert namespace == demo.NAMESPACE
        assert int(port) in ports, f"the sidecar serves {ports}, the hint says {port}"
        assert path == "metrics"
    # a pod port-forward would need a server on all addresses; the sidecar's is not
    assert not listens_on_all_addresses(sidecar)
    for target, port in re.findall(r"port-forward pod/(\S+) (\d+)", HINTS):
        assert int(port) not in ports, f"port-forward pod/{target} {port}: bound to the pod IP"


def test_the_label_hints_select_the_jobs_pods() -> None:
    labels = built_pod()["metadata"]["labels"]
    selectors = re.findall(r"-l (\S+)=(\S+)", HINTS)
    assert selectors
    for key, value in selectors:
        assert labels.get(key) == value, f"{key}={value} selects no pod the operator builds"
