"""helm, built from its Go module, installs a chart into the local cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ctj_devcluster import Cluster

pytestmark = pytest.mark.cluster

CHART = {
    "Chart.yaml": "apiVersion: v2\nname: hello\nversion: 0.1.0\n",
    "values.yaml": "greeting: hi\nreplicas: 2\n",
    "templates/configmap.yaml": (
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-config\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    ),
    "templates/deployment.yaml": """apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}
spec:
  replicas: {{ .Values.replicas }}
  selector:
    matchLabels: {app: {{ .Release.Name }}}
  template:
    metadata:
      labels: {app: {{ .Release.Name }}}
    spec:
      terminationGracePeriodSeconds: 2
      containers:
      - name: main
        image: python:3.11
        command: [python, -c, "import signal; signal.pause()"]
""",
}


def test_helm_install_waits_for_a_deployment(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    chart = tmp_path / "hello"
    for rel, text in CHART.items():
        (chart / rel).parent.mkdir(parents=True, exist_ok=True)
        (chart / rel).write_text(text)
    assert "v3." in cluster.helm("version", "--short").stdout
    cluster.helm(
        "install",
        "demo",
        str(chart),
        "-n",
        namespace,
        "--set",
        "greeting=hello",
        "--wait",
        "--timeout=90s",
        timeout=120,
    )
    releases = json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout)
    assert [(r["name"], r["status"]) for r in releases] == [("demo", "deployed")]
    config = json.loads(
        cluster.kubectl("get", "configmap", "demo-config", "-n", namespace, "-o", "json").stdout
    )
    assert config["data"] == {"greeting": "hello"}
    deploy = json.loads(
        cluster.kubectl("get", "deployment", "demo", "-n", namespace, "-o", "json").stdout
    )
    assert deploy["status"]["readyReplicas"] == 2
    cluster.helm("uninstall", "demo", "-n", namespace, "--wait", "--timeout=60s", timeout=90)
    assert json.loads(cluster.helm("list", "-n", namespace, "-o", "json").stdout) == []
