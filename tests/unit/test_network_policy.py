"""The per-job NetworkPolicy (ctj_operator.network_policy): read by what it lets through.

``allows`` below evaluates a NetworkPolicy the way the API documents it (a pod it
selects admits a connection if any ingress rule has a peer matching the source and a
port matching the destination; peers without a namespaceSelector mean the policy's own
namespace), so each case states a connection and whether it gets in.
"""

from __future__ import annotations

from typing import Any

import pytest
from ctj_contract import GROUP, KIND, LABEL_JOB, VERSION
from ctj_operator.builders import CACHE_PORT, METRICS_PORT
from ctj_operator.network_policy import (
    NAMESPACE_NAME_LABEL,
    NetworkPolicyParams,
    NetworkPolicyParamsError,
    PeerSelector,
    build_network_policy,
    network_policy_name,
)

JOB_NS = "team-a"
OP_NS = "ctj-system"
BODY = {
    "apiVersion": f"{GROUP}/{VERSION}",
    "kind": KIND,
    "metadata": {"name": "llm", "namespace": JOB_NS, "uid": "uid-1"},
}
OPERATOR = {"app.kubernetes.io/name": "ctj", "app.kubernetes.io/component": "operator"}
AGENT = {"app.kubernetes.io/name": "ctj", "app.kubernetes.io/component": "node-agent"}
PROMETHEUS = {"app.kubernetes.io/name": "prometheus"}
C10D = 29501


def _matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for e in selector.get("matchExpressions") or []:
        have = e["key"] in labels
        ok = {
            "In": have and labels.get(e["key"]) in e.get("values", []),
            "NotIn": not have or labels[e["key"]] not in e.get("values", []),
            "Exists": have,
            "DoesNotExist": not have,
        }[e["operator"]]
        if not ok:
            return False
    return True


def allows(
    policy: dict[str, Any], *, ns: str, pod: dict[str, str], port: int, to: dict[str, str]
) -> bool:
    """Whether a TCP connection from a pod labelled ``pod`` in namespace ``ns`` to port
    ``port`` of a pod labelled ``to`` in the policy's namespace gets in."""
    spec = policy["spec"]
    if not _matches(spec["podSelector"], to):
        return True  # not selected: the policy says nothing about it
    ns_labels = {NAMESPACE_NAME_LABEL: ns}
    for rule in spec.get("ingress") or []:
        ports = rule.get("ports")
        if ports and not any(
            p.get("protocol", "TCP") == "TCP" and p["port"] == port for p in ports
        ):
            continue
        for peer in rule.get("from") or [{}]:
            if "namespaceSelector" in peer:
                if not _matches(peer["namespaceSelector"], ns_labels):
                    continue
            elif ns != policy["metadata"]["namespace"]:
                continue
            if _matches(peer.get("podSelector") or {}, pod):
                return True
    return False


def _params(**kw: Any) -> NetworkPolicyParams:
    kw.setdefault("operator_namespace", OP_NS)
    kw.setdefault("operator_labels", OPERATOR)
    kw.setdefault("node_agent_labels", AGENT)
    return NetworkPolicyParams(**kw)


RANK = {LABEL_JOB: "llm", f"{GROUP}/attempt": "3", f"{GROUP}/node-rank": "1"}

CASES = [
    # (who, namespace, labels, port, admitted)
    ("another rank, rendezvous", JOB_NS, {LABEL_JOB: "llm"}, C10D, True),
    ("another rank, peer cache", JOB_NS, {LABEL_JOB: "llm"}, CACHE_PORT, True),
    ("another rank, metrics", JOB_NS, {LABEL_JOB: "llm"}, METRICS_PORT, True),
    ("a node agent, peer cache", OP_NS, AGENT, CACHE_PORT, True),
    ("a node agent, metrics", OP_NS, AGENT, METRICS_PORT, False),
    ("a node agent, rendezvous", OP_NS, AGENT, C10D, False),
    ("the operator, metrics", OP_NS, OPERATOR, METRICS_PORT, True),
    ("the operator, peer cache", OP_NS, OPERATOR, CACHE_PORT, False),
    ("prometheus anywhere, metrics", "monitoring", PROMETHEUS, METRICS_PORT, True),
    ("prometheus, peer cache", "monitoring", PROMETHEUS, CACHE_PORT, False),
    ("another job's rank, peer cache", JOB_NS, {LABEL_JOB: "other"}, CACHE_PORT, False),
    ("an unlabelled pod beside it", JOB_NS, {}, CACHE_PORT, False),
    ("a pod labelled as the job elsewhere", "team-b", {LABEL_JOB: "llm"}, CACHE_PORT, False),
    ("a node agent label outside the operator's namespace", JOB_NS, AGENT, CACHE_PORT, False),
    ("an operator label outside its namespace", "team-b", OPERATOR, METRICS_PORT, False),
]


@pytest.mark.parametrize(
    ("who", "ns", "labels", "port", "admitted"), CASES, ids=[c[0] for c in CASES]
)
def test_who_reaches_which_port_of_a_rank(
    who: str, ns: str, labels: dict[str, str], port: int, admitted: bool
) -> None:
    policy = build_network_policy(BODY, _params())
    assert allows(policy, ns=ns, pod=labels, port=port, to=RANK) is admitted


def test_the_policy_is_the_jobs_own_ingress_only_and_goes_with_it() -> None:
    policy = build_network_policy(BODY, _params())
    meta = policy["metadata"]
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    assert meta["name"] == network_policy_name("llm") == "llm-ctj"
    assert meta["namespace"] == JOB_NS
    assert meta["labels"] == {LABEL_JOB: "llm"}
    (owner,) = meta["ownerReferences"]
    assert (owner["kind"], owner["name"], owner["uid"]) == (KIND, "llm", "uid-1")
    assert owner["controller"] is True
    assert policy["spec"]["podSelector"] == {"matchLabels": {LABEL_JOB: "llm"}}
    # egress stays the user's: an Ingress-only policy isolates nothing outbound
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert "egress" not in policy["spec"]


def test_pods_of_other_jobs_are_not_selected() -> None:
    policy = build_network_policy(BODY, _params())
    other = {LABEL_JOB: "other"}
    assert allows(policy, ns="anywhere", pod={}, port=CACHE_PORT, to=other)


def test_without_prometheus_only_the_operator_reaches_the_metrics_port() -> None:
    policy = build_network_policy(BODY, _params(prometheus=None))
    assert not allows(policy, ns="monitoring", pod=PROMETHEUS, port=METRICS_PORT, to=RANK)
    assert allows(policy, ns=OP_NS, pod=OPERATOR, port=METRICS_PORT, to=RANK)


def test_a_prometheus_selector_of_ones_own() -> None:
    prometheus = PeerSelector(
        namespace_selector={"matchLabels": {NAMESPACE_NAME_LABEL: "obs"}},
        pod_selector={"matchExpressions": [{"key": "app", "operator": "In", "values": ["vm"]}]},
    )
    policy = build_network_policy(BODY, _params(prometheus=prometheus))
    assert allows(policy, ns="obs", pod={"app": "vm"}, port=METRICS_PORT, to=RANK)
    assert not allows(policy, ns="obs", pod={"app": "prometheus"}, port=METRICS_PORT, to=RANK)
    assert not allows(policy, ns="monitoring", pod={"app": "vm"}, port=METRICS_PORT, to=RANK)
    # the builder copies: editing the policy leaves the params as they were
    rule = policy["spec"]["ingress"][-1]["from"][0]
    rule["podSelector"]["matchExpressions"][0]["values"].append("x")
    assert prometheus.pod_selector["matchExpressions"][0]["values"] == ["vm"]


def test_ports_follow_the_params() -> None:
    policy = build_network_policy(BODY, _params(metrics_port=9500, cache_port=9502))
    assert allows(policy, ns=OP_NS, pod=AGENT, port=9502, to=RANK)
    assert not allows(policy, ns=OP_NS, pod=AGENT, port=CACHE_PORT, to=RANK)
    assert allows(policy, ns=OP_NS, pod=OPERATOR, port=9500, to=RANK)


def test_defaults_select_by_component_in_the_operators_namespace() -> None:
    policy = build_network_policy(BODY, NetworkPolicyParams(operator_namespace=OP_NS))
    component = "app.kubernetes.io/component"
    assert allows(policy, ns=OP_NS, pod={component: "node-agent"}, port=CACHE_PORT, to=RANK)
    assert allows(policy, ns=OP_NS, pod={component: "operator"}, port=METRICS_PORT, to=RANK)
    assert allows(policy, ns="monitoring", pod=PROMETHEUS, port=METRICS_PORT, to=RANK)


BAD = [
    ({"operator_namespace": ""}, "operator_namespace"),
    ({"operator_namespace": "Ctj_System"}, "operator_namespace"),
    ({"operator_labels": {}}, "operator_labels is empty"),
    ({"node_agent_labels": {}}, "node_agent_labels is empty"),
    ({"node_agent_labels": {"app": "a b"}}, "node_agent_labels['app']"),
    ({"operator_labels": {"-bad": "x"}}, "operator_labels: '-bad'"),
    ({"metrics_port": 0}, "metrics_port=0"),
    ({"cache_port": 70000}, "cache_port=70000"),
    ({"cache_port": True}, "cache_port=True"),
    ({"metrics_port": 9402, "cache_port": 9402}, "both 9402"),
    ({"prometheus": {"podSelector": {}}}, "prometheus: give a PeerSelector"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m for _, m in BAD])
def test_params_that_cannot_work_are_refused_naming_the_field(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(NetworkPolicyParamsError, match=message.replace("[", r"\[")):
        _params(**change)


BAD_SELECTORS = [
    ({"podSelector": {}}, "unknown key"),
    ({"matchLabels": {"a": 1}}, r"matchLabels\['a'\]"),
    ({"matchExpressions": [{"key": "a", "operator": "Has"}]}, "operator must be one of"),
    ({"matchExpressions": [{"key": "a", "operator": "In"}]}, "In needs values"),
    ({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]}, "takes no"),
    ({"matchExpressions": {"key": "a"}}, "give a list"),
]


@pytest.mark.parametrize(("selector", "message"), BAD_SELECTORS, ids=[m for _, m in BAD_SELECTORS])
def test_a_prometheus_selector_that_is_not_one_is_refused(
    selector: dict[str, Any], message: str
) -> None:
    with pytest.raises(NetworkPolicyParamsError, match=f"prometheus.podSelector.*{message}"):
        PeerSelector(pod_selector=selector)
