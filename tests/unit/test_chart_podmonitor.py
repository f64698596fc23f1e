"""The chart's PodMonitor, rendered by the real helm (skipped, saying how to build it, where
helm is missing): every sidecar series gets the job's name as ``job_name`` and the pod's
``namespace``, from the label the operator puts on every pod it creates."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
import yaml
from ctj_contract import LABEL_JOB
from ctj_devcluster.binaries import BinariesMissing, find_helm

from tests.unit.test_chart_files import CHART


def rendered_pod_monitor(*sets: str) -> list[dict[str, Any]]:
    try:
        helm = find_helm()
    except BinariesMissing as exc:
        pytest.skip(str(exc))
    args = [str(helm), "template", "ctj", str(CHART), "-n", "ctj-system"]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PodMonitor"]


def discovery_label(pod_label: str) -> str:
    """The name Prometheus' Kubernetes discovery gives a pod label."""
    return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", pod_label)


def test_the_pod_monitor_labels_every_series_with_its_job_and_namespace() -> None:
    assert rendered_pod_monitor() == []  # off by default
    (monitor,) = rendered_pod_monitor("podMonitor.enabled=true")
    (selector,) = monitor["spec"]["selector"]["matchExpressions"]
    assert selector == {"key": LABEL_JOB, "operator": "Exists"}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    targets = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert targets == {
        "job_name": [discovery_label(LABEL_JOB)],
        "namespace": ["__meta_kubernetes_namespace"],
    }
    assert discovery_label(LABEL_JOB) == "__meta_kubernetes_pod_label_training_ctj_dev_job_name"
