"""The per-job NetworkPolicy: who may connect to a job's pods.

A job's pods listen on the pod network: the sidecar's peer cache (9402, ``peer-cache``:
chunks for the job's other ranks, authenticated by the job's token) and its metrics and
heartbeat (9400, ``metrics``: the operator polls it, Prometheus scrapes it), and the
trainers' rendezvous (c10d on the attempt's master port) and collectives (NCCL/gloo on
ports they pick). The token keeps a stranger from reading chunks; the policy keeps a
stranger from connecting at all, as a platform team expects of any workload.

What it allows (Ingress only; egress is the user's to restrict):

- the job's own pods, on every port (rendezvous, collectives, each other's peer cache);
- the node agents (in the operator's namespace) to the peer-cache port;
- the operator's pods to the metrics port (heartbeats, checkpoint requests);
- Prometheus (a configurable namespace and pod selector) to the metrics port.

What it does to a user's other traffic: a pod some policy selects is isolated for
ingress, so anything else that connected to the trainer before (a TensorBoard or
debugger port, the user's own scraper of the trainer's metrics, a Service in front of
it) is refused once this policy exists. Policies are additive: the user allows more
with a NetworkPolicy of their own selecting ``training.ctj.dev/job-name: <job>``, or
turns ours off (the operator's flag; the chart's ``networkPolicy.enabled``). Traffic
from the node itself (kubelet probes) is left alone by the common enforcers.

The policy trusts the label: any pod in the job's namespace labelled as the job's is
let in, so whoever can create pods there can reach the ranks (they can read the job's
token Secret by secretKeyRef too: the namespace is the trust boundary).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

from ctj_contract import LABEL_JOB

from .builders import CACHE_PORT, METRICS_PORT, owner_reference

NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace (1.21+): selects one namespace by name."""

DEFAULT_OPERATOR_LABELS: Mapping[str, str] = {"app.kubernetes.io/component": "operator"}
DEFAULT_NODE_AGENT_LABELS: Mapping[str, str] = {"app.kubernetes.io/component": "node-agent"}
DEFAULT_PROMETHEUS_POD_SELECTOR: Mapping[str, Any] = {
    "matchLabels": {"app.kubernetes.io/name": "prometheus"}
}
"""The label prometheus-operator's and the community chart's Prometheus pods carry."""

_SELECTOR_KEYS = frozenset({"matchLabels", "matchExpressions"})
_OPERATORS = frozenset({"In", "NotIn", "Exists", "DoesNotExist"})
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?)$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def network_policy_name(job: str) -> str:
    """``<job>-ctj``: the job-name rule leaves room for it (a DNS subdomain, 253)."""
    return f"{job}-ctj"


class NetworkPolicyParamsError(ValueError):
    """A setting the policy cannot be built from; the message names it and the fix."""


def _check_label_key(field: str, key: object) -> None:
    if not isinstance(key, str):
        raise NetworkPolicyParamsError(f"{field}: label key {key!r} is not a string")
    prefix, _, name = key.rpartition("/")
    if (prefix and not _DNS_SUBDOMAIN.match(prefix)) or not _LABEL_NAME.match(name):
        raise NetworkPolicyParamsError(
            f"{field}: {key!r} is not a label key ([prefix/]name, name up to 63 of "
            "[A-Za-z0-9-_.], starting and ending alphanumeric)"
        )


def _check_labels(field: str, labels: object, *, allow_empty: bool) -> None:
    if not isinstance(labels, Mapping):
        raise NetworkPolicyParamsError(f"{field}: give a mapping of label keys to values")
    if not labels and not allow_empty:
        raise NetworkPolicyParamsError(
            f"{field} is empty: it would select every pod of the namespace; name the labels "
            "of the pods to let in"
        )
    for key, value in labels.items():
        _check_label_key(field, key)
        if not isinstance(value, str) or not _LABEL_VALUE.match(value):
            raise NetworkPolicyParamsError(
                f"{field}[{key!r}]={value!r} is not a label value (up to 63 of "
                "[A-Za-z0-9-_.], starting and ending alphanumeric)"
            )


def _check_selector(field: str, selector: object) -> None:
    """A metav1.LabelSelector: matchLabels and/or matchExpressions ({} selects all)."""
    if not isinstance(selector, Mapping):
        raise NetworkPolicyParamsError(f"{field}: give a label selector (matchLabels, ...)")
    unknown = set(selector) - _SELECTOR_KEYS
    if unknown:
        raise NetworkPolicyParamsError(
            f"{field}: unknown key(s) {sorted(unknown)}: a label selector has "
            "matchLabels and matchExpressions"
        )
    _check_labels(f"{field}.matchLabels", selector.get("matchLabels") or {}, allow_empty=True)
    expressions = selector.get("matchExpressions") or []
    if not isinstance(expressions, list):
        raise NetworkPolicyParamsError(f"{field}.matchExpressions: give a list")
    for i, expr in enumerate(expressions):
        where = f"{field}.matchExpressions[{i}]"
        if not isinstance(expr, Mapping) or expr.get("operator") not in _OPERATORS:
            raise NetworkPolicyParamsError(f"{where}: operator must be one of {sorted(_OPERATORS)}")
        _check_label_key(where, expr.get("key"))
        values = expr.get("values") or []
        if expr["operator"] in ("In", "NotIn") and not values:
            raise NetworkPolicyParamsError(f"{where}: {expr['operator']} needs values")
        if expr["operator"] in ("Exists", "DoesNotExist") and values:
            raise NetworkPolicyParamsError(f"{where}: {expr['operator']} takes no values")


def _check_port(field: str, port: object) -> None:
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise NetworkPolicyParamsError(f"{field}={port!r} is not a TCP port (1-65535)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PeerSelector:
    """Pods selected by both selectors (a NetworkPolicyPeer): ``namespace_selector`` {}
    means every namespace, ``pod_selector`` {} every pod of those."""

    namespace_selector: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    pod_selector: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_selector("prometheus.namespaceSelector", self.namespace_selector)
        _check_selector("prometheus.podSelector", self.pod_selector)

    def peer(self) -> dict[str, Any]:
        return {
            "namespaceSelector": _copy_selector(self.namespace_selector),
            "podSelector": _copy_selector(self.pod_selector),
        }


def _copy_selector(selector: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if selector.get("matchLabels"):
        out["matchLabels"] = dict(selector["matchLabels"])
    if selector.get("matchExpressions"):
        out["matchExpressions"] = [
            {k: (list(v) if k == "values" else v) for k, v in e.items()}
            for e in selector["matchExpressions"]
        ]
    return out


def default_prometheus() -> PeerSelector:
    return PeerSelector(pod_selector=DEFAULT_PROMETHEUS_POD_SELECTOR)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class NetworkPolicyParams:
    """What the per-job policy lets in besides the job's own pods."""

    operator_namespace: str
    """Where the operator and the node agents run (the chart's release namespace)."""
    operator_labels: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_OPERATOR_LABELS)
    )
    """Labels of the operator's pods there: they poll each rank's metrics port."""
    node_agent_labels: Mapping[str, str] = dataclasses.field(
        default_factory=lambda: dict(DEFAULT_NODE_AGENT_LABELS)
    )
    """Labels of the node agents' pods there: they reach each rank's peer-cache port."""
    prometheus: PeerSelector | None = dataclasses.field(default_factory=default_prometheus)
    """Who scrapes the metrics port; None lets no scraper in."""
    metrics_port: int = METRICS_PORT
    cache_port: int = CACHE_PORT

    def __post_init__(self) -> None:
        if not isinstance(self.operator_namespace, str) or not _DNS_LABEL.match(
            self.operator_namespace
        ):
            raise NetworkPolicyParamsError(
                f"operator_namespace={self.operator_namespace!r} is not a namespace name "
                "(the operator's own: its POD_NAMESPACE)"
            )
        _check_labels("operator_labels", self.operator_labels, allow_empty=False)
        _check_labels("node_agent_labels", self.node_agent_labels, allow_empty=False)
        if self.prometheus is not None and not isinstance(self.prometheus, PeerSelector):
            raise NetworkPolicyParamsError("prometheus: give a PeerSelector, or None for none")
        _check_port("metrics_port", self.metrics_port)
        _check_port("cache_port", self.cache_port)
        if self.metrics_port == self.cache_port:
            raise NetworkPolicyParamsError(
                f"metrics_port and cache_port are both {self.cache_port}: the node agents "
                "would reach the metrics and the operator the cache; give them apart"
            )


def _tcp(port: int) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port}]


def build_network_policy(body: Mapping[str, Any], params: NetworkPolicyParams) -> dict[str, Any]:
    """The NetworkPolicy ``<job>-ctj`` in the job's namespace, owned by the job (deleted
    with it), selecting its pods by ``LABEL_JOB``."""
    meta = body["metadata"]
    job = meta["name"]
    operator_namespace = {"matchLabels": {NAMESPACE_NAME_LABEL: params.operator_namespace}}
    ingress: list[dict[str, Any]] = [
        # rendezvous, collectives and peer caches: every port, between the job's pods
        {"from": [{"podSelector": {"matchLabels": {LABEL_JOB: job}}}]},
        {
            "from": [
                {
                    "namespaceSelector": operator_namespace,
                    "podSelector": {"matchLabels": dict(params.node_agent_labels)},
                }
            ],
            "ports": _tcp(params.cache_port),
        },
        {
            "from": [
                {
                    "namespaceSelector": operator_namespace,
                    "podSelector": {"matchLabels": dict(params.operator_labels)},
                }
            ],
            "ports": _tcp(params.metrics_port),
        },
    ]
    if params.prometheus is not None:
        ingress.append({"from": [params.prometheus.peer()], "ports": _tcp(params.metrics_port)})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {
            "name": network_policy_name(job),
            "namespace": meta["namespace"],
            "labels": {LABEL_JOB: job},
            "ownerReferences": [owner_reference(dict(body))],
        },
        "spec": {
            "podSelector": {"matchLabels": {LABEL_JOB: job}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }
