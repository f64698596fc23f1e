"""The chart's NetworkPolicies (templates/networkpolicy.yaml), rendered by the real helm
against the chart's values.schema.json: which pods they select (the very pods the
chart's Deployment and DaemonSet run) and who may connect to which of their ports."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml
from ctj_contract import LABEL_JOB

from tests.unit.chart_helm import CHART, Helm, helm, render
from tests.unit.test_network_policy import allows

__all__ = ["helm"]  # the fixture, used by name

NS = "ctj-system"
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}


def render_json(helm: Helm, *set_json: str) -> dict[tuple[str, str], Any]:
    """`helm template --set-json ...` (values that are lists or objects)."""
    args = ["template", "ctj-operator", str(CHART), "-n", NS]
    for s in set_json:
        args += ["--set-json", s]
    docs = yaml.safe_load_all(helm(*args).stdout)
    return {(d["kind"], d["metadata"]["name"]): d for d in docs if d}


def policies(objects: dict[tuple[str, str], Any]) -> dict[str, Any]:
    return {name: o for (kind, name), o in objects.items() if kind == "NetworkPolicy"}


def pod_labels(objects: dict[tuple[str, str], Any], kind: str) -> dict[str, str]:
    (workload,) = [o for (k, _), o in objects.items() if k == kind]
    return dict(workload["spec"]["template"]["metadata"]["labels"])


def port(objects: dict[tuple[str, str], Any], kind: str, name: str) -> int:
    (workload,) = [o for (k, _), o in objects.items() if k == kind]
    containers = workload["spec"]["template"]["spec"]["containers"]
    ports = [p for c in containers for p in c.get("ports") or []]  # the mounter has none
    return int(next(p["containerPort"] for p in ports if p["name"] == name))


def test_by_default_the_operator_takes_only_prometheus_on_its_metrics_port(helm: Helm) -> None:
    objects = render(helm, namespace=NS)
    policy = policies(objects)["ctj-operator-operator"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    operator = pod_labels(objects, "Deployment")
    agent = pod_labels(objects, "DaemonSet")
    metrics = port(objects, "Deployment", "metrics")
    liveness = port(objects, "Deployment", "liveness")
    assert allows(policy, ns="monitoring", pod=PROMETHEUS, port=metrics, to=operator)
    assert not allows(policy, ns="monitoring", pod=PROMETHEUS, port=liveness, to=operator)
    assert not allows(policy, ns="team-a", pod={LABEL_JOB: "llm"}, port=metrics, to=operator)
    assert not allows(policy, ns=NS, pod={}, port=metrics, to=operator)
    # it selects the operator's pods, not the node agents beside them
    assert allows(policy, ns="team-a", pod={}, port=9403, to=agent)


def test_the_node_agents_take_any_jobs_pods_and_each_other_on_their_port(helm: Helm) -> None:
    objects = render(helm, namespace=NS)
    policy = policies(objects)["ctj-operator-node-agent"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    agent = pod_labels(objects, "DaemonSet")
    operator = pod_labels(objects, "Deployment")
    cache = port(objects, "DaemonSet", "node-cache")
    for ns in ("team-a", "team-b", NS):
        assert allows(policy, ns=ns, pod={LABEL_JOB: "any-job"}, port=cache, to=agent)
    assert allows(policy, ns=NS, pod=agent, port=cache, to=agent)
    assert not allows(policy, ns="team-a", pod={LABEL_JOB: "llm"}, port=cache + 1, to=agent)
    assert not allows(policy, ns="team-a", pod={"app": "web"}, port=cache, to=agent)
    assert not allows(policy, ns="monitoring", pod=PROMETHEUS, port=cache, to=agent)
    assert not allows(policy, ns=NS, pod=operator, port=cache, to=agent)
    # an agent's labels in another namespace are anyone's to set
    assert not allows(policy, ns="team-a", pod=agent, port=cache, to=agent)
    assert policy["metadata"]["labels"]["app.kubernetes.io/component"] == "node-agent"


def test_prometheus_is_found_where_the_values_say(helm: Helm) -> None:
    objects = render(
        helm,
        "networkPolicy.prometheus.namespaceSelector.matchLabels.kubernetes\\.io/metadata\\.name=obs",
        "networkPolicy.prometheus.podSelector.matchLabels.app=vmagent",
        namespace=NS,
    )
    policy = policies(objects)["ctj-operator-operator"]
    operator = pod_labels(objects, "Deployment")
    metrics = port(objects, "Deployment", "metrics")
    # matchLabels merge with the default's: the user's label joins it
    vm = {"app": "vmagent", **PROMETHEUS}
    assert allows(policy, ns="obs", pod=vm, port=metrics, to=operator)
    assert not allows(policy, ns="monitoring", pod=vm, port=metrics, to=operator)


def test_without_prometheus_the_operator_takes_no_connection(helm: Helm) -> None:
    objects = render(helm, "networkPolicy.prometheus.enabled=false", namespace=NS)
    policy = policies(objects)["ctj-operator-operator"]
    assert policy["spec"]["ingress"] == []
    operator = pod_labels(objects, "Deployment")
    metrics = port(objects, "Deployment", "metrics")
    assert not allows(policy, ns="monitoring", pod=PROMETHEUS, port=metrics, to=operator)


def test_extra_peers_reach_the_node_agents(helm: Helm) -> None:
    extra = [{"ipBlock": {"cidr": "172.18.0.0/16"}}]
    objects = render_json(helm, f"networkPolicy.nodeAgent.extraFrom={json.dumps(extra)}")
    (rule,) = policies(objects)["ctj-operator-node-agent"]["spec"]["ingress"]
    assert rule["from"][-1] == extra[0] and len(rule["from"]) == 3


def test_off_makes_none_and_no_node_cache_makes_no_agent_policy(helm: Helm) -> None:
    assert policies(render(helm, "networkPolicy.enabled=false")) == {}
    assert list(policies(render(helm, "nodeCache.enabled=false"))) == ["ctj-operator-operator"]


@pytest.mark.parametrize(
    ("set_json", "complaint"),
    [
        ('networkPolicy.enabled="yes"', "/networkPolicy/enabled"),
        ('networkPolicy.prometheus.podSelector={"app":"x"}', "podSelector"),
        (
            'networkPolicy.prometheus.podSelector={"matchExpressions":[{"key":"a","operator":"Has"}]}',
            "operator",
        ),
        ('networkPolicy.nodeAgent.extraFrom=[{"cidr":"10.0.0.0/8"}]', "extraFrom"),
        ("networkPolicy.nodeAgent.extraFrom=[{}]", "extraFrom"),
        ('networkPolicy.mode="strict"', "mode"),
    ],
)
def test_the_schema_refuses_values_that_are_not_policies(
    helm: Helm, set_json: str, complaint: str
) -> None:
    proc = helm("template", "x", str(CHART), "--set-json", set_json, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert complaint in proc.stderr
