"""The checkpoint sidecar's default resources, and the QoS class of the pods the operator
builds: a template whose own containers are Guaranteed stays Guaranteed with our
containers added (the sidecar, and the node cache's permission step), so the trainer
keeps the kubelet's exclusive CPUs and topology alignment.

``pod_qos`` computes the class as Kubernetes does (pkg/apis/core/helper/qos, v1.34), from
the pod as the API server stores it (a limit without a request defaults the request).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from ctj_operator import builders
from ctj_operator.quantities import parse_quantity
from ctj_operator.spec import JobSpec, NodeCache

BODY = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u-1"}}
URI = "s3://bucket/jobs/ml/demo-u-1"
CACHE = NodeCache()
QOS_RESOURCES = ("cpu", "memory")  # the only ones QoS looks at (extended ones are ignored)


def _defaulted(resources: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """requests and limits as stored: a request left out where a limit is set is the limit."""
    resources = resources or {}
    limits = dict(resources.get("limits") or {})
    requests = {**limits, **(resources.get("requests") or {})}
    return requests, limits


def pod_qos(pod_spec: dict[str, Any]) -> str:
    """Guaranteed, Burstable or BestEffort, as the kubelet and the API server compute it:
    over every container, init containers included (ephemeral ones have no resources);
    pod-level ``resources``, where set, decide alone."""
    if pod_spec.get("resources"):
        sources = [pod_spec["resources"]]
    else:
        containers = (pod_spec.get("containers") or []) + (pod_spec.get("initContainers") or [])
        sources = [c.get("resources") for c in containers]
    requests: dict[str, float] = {}
    limits: dict[str, float] = {}
    guaranteed = True
    for resources in sources:
        want, cap = _defaulted(resources)
        for name, value in want.items():
            if name in QOS_RESOURCES and parse_quantity(value) > 0:
                requests[name] = requests.get(name, 0) + parse_quantity(value)
        found = set()
        for name, value in cap.items():
            if name in QOS_RESOURCES and parse_quantity(value) > 0:
                found.add(name)
                limits[name] = limits.get(name, 0) + parse_quantity(value)
        if not set(QOS_RESOURCES) <= found:
            guaranteed = False
    if not requests and not limits:
        return "BestEffort"
    if guaranteed and all(limits.get(n) == v for n, v in requests.items()):
        if len(requests) == len(limits):
            return "Guaranteed"
    return "Burstable"


EXACT = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}


@pytest.mark.parametrize(
    ("pod_spec", "qos"),
    [
        ({"containers": [{"name": "a"}]}, "BestEffort"),
        ({"containers": [{"name": "a", "resources": EXACT}]}, "Guaranteed"),
        # limits alone: the requests default to them
        ({"containers": [{"name": "a", "resources": {"limits": EXACT["limits"]}}]}, "Guaranteed"),
        ({"containers": [{"name": "a", "resources": {"requests": {"cpu": "1"}}}]}, "Burstable"),
        # a GPU is no QoS resource: cpu and memory still decide
        ({"containers": [{"name": "a", "resources": {
            "limits": {**EXACT["limits"], "nvidia.com/gpu": "1"}}}]}, "Guaranteed"),
        ({"containers": [{"name": "a", "resources": {
            "requests": {"cpu": "2", "memory": "8Gi"}, "limits": EXACT["limits"]}}]}, "Burstable"),
        # one container without limits spoils it, an init container too
        ({"containers": [{"name": "a", "resources": EXACT}, {"name": "b"}]}, "Burstable"),
        ({"containers": [{"name": "a", "resources": EXACT}],
          "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1m"}}}]},
         "Burstable"),
        ({"containers": [{"name": "a"}], "resources": EXACT}, "Guaranteed"),
    ],
)  # fmt: skip
def test_pod_qos_is_computed_as_kubernetes_does(pod_spec: dict[str, Any], qos: str) -> None:
    assert pod_qos(pod_spec) == qos


def test_the_default_sidecar_requests_exactly_its_limits() -> None:
    default = builders.DEFAULT_SIDECAR_RESOURCES
    assert default["requests"] == default["limits"]
    assert set(default["limits"]) == {"cpu", "memory"}


def built(spec: JobSpec) -> dict[str, Any]:
    pod = builders.build_pod(BODY, spec, uri=URI, attempt=1, world_size=2, node_rank=0)
    return pod["spec"]


def sidecar_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    (sidecar,) = [c for c in pod_spec["initContainers"] if c["name"] == builders.SIDECAR_NAME]
    return sidecar


GPU_TRAINER = {
    "name": "trainer",
    "image": "trainer:1",
    "resources": {
        "requests": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "8"},
        "limits": {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "8"},
    },
}


@pytest.mark.parametrize("cached", [False, True], ids=["no-node-cache", "node-cache"])
@pytest.mark.parametrize(
    "template_spec",
    [
        {"containers": [GPU_TRAINER]},
        # limits only (requests defaulted), and an init container of the template's own
        {"containers": [{"name": "t", "resources": {"limits": {"cpu": "2", "memory": "4Gi"}}}],
         "initContainers": [{"name": "fetch", "resources": EXACT}]},
    ],
    ids=["gpu", "limits-only"],
)  # fmt: skip
def test_a_guaranteed_template_builds_a_guaranteed_pod(
    template_spec: dict[str, Any], cached: bool
) -> None:
    assert pod_qos(template_spec) == "Guaranteed"
    spec = JobSpec.parse(
        {"replicas": 2, "checkpoint": {"uri": "s3://b/j"}, "template": {"spec": template_spec}},
        node_cache=CACHE if cached else None,
    )
    pod_spec = built(spec)
    # no step of ours but the sidecar, node cache on or off (the node agent owns the disk)
    assert "ctj-cache-permissions" not in {c["name"] for c in pod_spec["initContainers"]}
    assert pod_qos(pod_spec) == "Guaranteed", pod_spec["initContainers"]
    assert sidecar_of(pod_spec)["resources"] == builders.DEFAULT_SIDECAR_RESOURCES
    # the pytorchjob backend's pods carry the same containers of ours (the Kubeflow
    # controller adds an init container of its own to the Workers, which ours cannot fix)
    kf = builders.build_pytorchjob(BODY, spec, uri=URI, attempt=1, world_size=2)
    for kind in ("Master", "Worker"):
        assert pod_qos(kf["spec"]["pytorchReplicaSpecs"][kind]["template"]["spec"]) == (
            "Guaranteed"
        )


def test_a_template_that_is_not_guaranteed_stays_as_it_was_or_burstable() -> None:
    burstable = {"containers": [{"name": "t", "resources": {"requests": {"cpu": "1"}}}]}
    assert pod_qos(built(JobSpec.parse(
        {"replicas": 1, "checkpoint": {"uri": "s3://b/j"}, "template": {"spec": burstable}}
    ))) == "Burstable"  # fmt: skip
    # a BestEffort template gets a sidecar that requests something: Burstable
    best_effort = {"containers": [{"name": "t"}]}
    assert pod_qos(built(JobSpec.parse(
        {"replicas": 1, "checkpoint": {"uri": "s3://b/j"}, "template": {"spec": best_effort}}
    ))) == "Burstable"  # fmt: skip


def test_sidecar_resources_replace_the_default_as_a_whole() -> None:
    own = {"requests": {"cpu": "4", "memory": "8Gi"}, "limits": {"cpu": "4", "memory": "8Gi"}}
    template = {"containers": [GPU_TRAINER]}
    raw: dict[str, Any] = {
        "replicas": 1,
        "checkpoint": {"uri": "s3://b/j", "sidecarResources": own},
        "template": {"spec": template},
    }
    pod_spec = built(JobSpec.parse(copy.deepcopy(raw)))
    assert sidecar_of(pod_spec)["resources"] == own
    assert pod_qos(pod_spec) == "Guaranteed"
    # requests alone (as before this default existed): the job chose Burstable
    raw["checkpoint"]["sidecarResources"] = {"requests": {"cpu": "500m"}}
    pod_spec = built(JobSpec.parse(raw))
    assert sidecar_of(pod_spec)["resources"] == {"requests": {"cpu": "500m"}}
    assert pod_qos(pod_spec) == "Burstable"


def test_the_default_is_never_shared_between_pods() -> None:
    """Each pod gets its own copy: a later edit of one built pod changes no other."""
    spec = JobSpec.parse(
        {"replicas": 1, "checkpoint": {"uri": "s3://b/j"}, "template": {"spec": {
            "containers": [{"name": "t"}]}}}
    )  # fmt: skip
    first = sidecar_of(built(spec))
    first["resources"]["limits"]["cpu"] = "99"
    assert sidecar_of(built(spec))["resources"] == builders.DEFAULT_SIDECAR_RESOURCES
    assert builders.DEFAULT_SIDECAR_RESOURCES["limits"]["cpu"] != "99"
