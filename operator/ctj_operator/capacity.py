"""On which nodes one rank of a job can run, decided as kube-scheduler's filters would.

Pure: the inputs are the plain dicts the Kubernetes API returns in JSON (camelCase keys,
the shape kopf gives bodies); no client, no I/O, no clock. The operator's pods carry a
podAntiAffinity of one rank per node, so a job's capacity is the number of nodes that
fit one rank. Each rule mirrors one scheduler filter plugin (NodeUnschedulable,
NodeName, TaintToleration, NodeAffinity, NodeResourcesFit); docs/sizing.md lists them
and what is deliberately not modelled. Table-tested in tests/unit/test_capacity.py.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, TypeAlias

from ctj_contract import LABEL_JOB

from .quantities import INT64_MAX, base_units, format_amount, parse_quantity

Obj: TypeAlias = Mapping[str, Any]
"""One JSON object as the API returns it (a node, a pod, a pod spec, a taint...)."""

Resources: TypeAlias = Mapping[str, int]
"""Resource name -> amount in base units: cpu in millicores, memory and
ephemeral-storage (and hugepages-*) in bytes, extended resources and ``pods`` as counts."""

BLOCKING_EFFECTS = ("NoSchedule", "NoExecute")
UNSCHEDULABLE_TAINT: Obj = {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}
TERMINAL_PHASES = ("Succeeded", "Failed")
NODE_NAME_FIELD = "metadata.name"
# the order NodeResourcesFit checks them in; any other requested resource follows by name
_RESOURCE_ORDER = ("pods", "cpu", "memory", "ephemeral-storage")

_INT64 = re.compile(r"[+-]?[0-9]+")


def _exact(resource_list: Obj | None) -> dict[str, Fraction]:
    return {name: Fraction(parse_quantity(q)) for name, q in (resource_list or {}).items()}


def _to_base_units(exact: Mapping[str, Fraction]) -> dict[str, int]:
    return {name: base_units(name, value) for name, value in exact.items()}


# ---------------------------------------------------------------- what a pod requests


def container_requests(container: Obj) -> dict[str, Fraction]:
    """A container's requests after API defaulting: a resource with a limit and no
    request requests its limit."""
    resources = container.get("resources") or {}
    requests = _exact(resources.get("requests"))
    for name, limit in _exact(resources.get("limits")).items():
        requests.setdefault(name, limit)
    return requests


def _add(into: dict[str, Fraction], other: Mapping[str, Fraction]) -> None:
    for name, value in other.items():
        into[name] = into.get(name, Fraction(0)) + value


def _max(into: dict[str, Fraction], other: Mapping[str, Fraction]) -> None:
    for name, value in other.items():
        if name not in into or value > into[name]:
            into[name] = value


def pod_requests(pod_spec: Obj) -> dict[str, int]:
    """The pod's effective requests, as component-helpers' PodRequests computes them.

    Containers and sidecars (initContainers with ``restartPolicy: Always``) run together:
    their requests add up. Plain init containers run one at a time before the containers,
    each alongside the sidecars declared before it: the pod needs the largest of those
    moments, per resource. Pod-level ``resources.requests`` (cpu, memory) replace the
    containers' sum; ``overhead`` (RuntimeClass) is added. Summed exactly, then rounded
    to base units once, plus ``pods: 1``.
    """
    total: dict[str, Fraction] = {}
    for container in pod_spec.get("containers") or []:
        _add(total, container_requests(container))
    sidecars: dict[str, Fraction] = {}
    init_peak: dict[str, Fraction] = {}
    for container in pod_spec.get("initContainers") or []:
        requests = container_requests(container)
        if container.get("restartPolicy") == "Always":
            _add(total, requests)
            _add(sidecars, requests)
            _max(init_peak, sidecars)
        else:
            _add(requests, sidecars)
            _max(init_peak, requests)
    _max(total, init_peak)
    pod_level = _exact((pod_spec.get("resources") or {}).get("requests"))
    total |= {name: v for name, v in pod_level.items() if name in ("cpu", "memory")}
    _add(total, _exact(pod_spec.get("overhead")))
    return _to_base_units(total) | {"pods": 1}


def _job_of(pod: Obj) -> tuple[str, str] | None:
    meta = pod.get("metadata") or {}
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    return None if job is None else (meta.get("namespace") or "", job)


def used_by_pods(
    pods: Iterable[Obj], *, exclude_pods_of: tuple[str, str] | None = None
) -> dict[str, Resources]:
    """What the pods bound to each node request (node name -> summed ``pod_requests``).

    A pod counts from the moment ``spec.nodeName`` is set until it is Succeeded or Failed
    (the scheduler's own cache leaves terminal pods out); a terminating pod still counts.
    ``exclude_pods_of=(namespace, job)`` leaves out that job's pods, which a new attempt
    replaces.
    """
    used: dict[str, dict[str, int]] = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
            continue
        if exclude_pods_of is not None and _job_of(pod) == exclude_pods_of:
            continue
        on_node = used.setdefault(node, {})
        for name, amount in pod_requests(pod.get("spec") or {}).items():
            on_node[name] = on_node.get(name, 0) + amount
    return dict(used)


# ---------------------------------------------------------------- taints and tolerations


def _parse_int64(text: object) -> int | None:
    """strconv.ParseInt(text, 10, 64): optional sign, ASCII digits only, in range."""
    if not isinstance(text, str) or not _INT64.fullmatch(text):
        return None
    value = int(text)
    return value if -INT64_MAX - 1 <= value <= INT64_MAX else None


def toleration_matches(toleration: Obj, taint: Obj) -> bool:
    """Toleration.ToleratesTaint: an empty effect matches every effect and an empty key
    every key; operator Exists matches any value, Equal (or none) the same value, Gt/Lt
    (alpha) an integer taint value above/below the toleration's. tolerationSeconds only
    bounds how long a NoExecute taint is tolerated, so it plays no part here."""
    effect, key = toleration.get("effect") or "", toleration.get("key") or ""
    if effect and effect != (taint.get("effect") or ""):
        return False
    if key and key != (taint.get("key") or ""):
        return False
    operator = toleration.get("operator") or "Equal"
    if operator == "Equal":
        return (toleration.get("value") or "") == (taint.get("value") or "")
    if operator == "Exists":
        return True
    if operator in ("Gt", "Lt"):
        wanted, actual = _parse_int64(toleration.get("value")), _parse_int64(taint.get("value"))
        if wanted is None or actual is None:
            return False
        return actual > wanted if operator == "Gt" else actual < wanted
    return False


def tolerates(tolerations: Iterable[Obj] | None, taint: Obj) -> bool:
    """Whether ``taint`` lets the pod be scheduled: a PreferNoSchedule taint (or any
    effect but NoSchedule/NoExecute) never blocks; a blocking one needs a matching
    toleration."""
    if (taint.get("effect") or "") not in BLOCKING_EFFECTS:
        return True
    return any(toleration_matches(t, taint) for t in tolerations or [])


def format_taint(taint: Obj) -> str:
    """``key=value:Effect`` (``key:Effect`` without a value), as kubectl writes taints."""
    value = taint.get("value") or ""
    return f"{taint.get('key') or ''}{'=' + value if value else ''}:{taint.get('effect') or ''}"


# ---------------------------------------------------------------- node selector and affinity


def _label_requirement_matches(expr: Obj, labels: Mapping[str, str]) -> bool | None:
    """One matchExpressions entry against the node's labels; None when it is invalid
    (labels.NewRequirement's rules), which makes its whole term match nothing."""
    key: str = expr.get("key") or ""
    op: str | None = expr.get("operator")
    values: list[str] = list(expr.get("values") or [])
    if op in ("In", "NotIn"):
        if not values:
            return None
        if key not in labels:
            return op == "NotIn"
        return (labels[key] in values) == (op == "In")
    if op in ("Exists", "DoesNotExist"):
        if values:
            return None
        return (key in labels) == (op == "Exists")
    if op in ("Gt", "Lt"):
        bound = _parse_int64(values[0]) if len(values) == 1 else None
        if bound is None:
            return None
        actual = _parse_int64(labels.get(key))
        if actual is None:
            return False
        return actual > bound if op == "Gt" else actual < bound
    return None


def _field_requirement_matches(expr: Obj, node_name: str) -> bool | None:
    """One matchFields entry: only ``metadata.name`` with In/NotIn and exactly one value
    exists; anything else is invalid (None)."""
    values: list[str] = list(expr.get("values") or [])
    op: str | None = expr.get("operator")
    if expr.get("key") != NODE_NAME_FIELD or op not in ("In", "NotIn") or len(values) != 1:
        return None
    return (node_name == values[0]) == (op == "In")


def _term_matches(term: Obj, labels: Mapping[str, str], node_name: str) -> bool:
    """A nodeSelectorTerm: every expression and every field requirement holds (ANDed).
    An empty term, or one with an invalid requirement, matches nothing."""
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    results = [_label_requirement_matches(e, labels) for e in expressions]
    results += [_field_requirement_matches(f, node_name) for f in fields]
    return all(r is True for r in results)


def matches_node_selector(pod_spec: Obj, node: Obj) -> bool:
    """The NodeAffinity filter: every ``nodeSelector`` label equals the node's, and, when
    ``requiredDuringSchedulingIgnoredDuringExecution`` is set, at least one of its
    nodeSelectorTerms matches (terms ORed; none at all matches nothing). Preferred
    affinity only scores nodes, so it is ignored."""
    meta = node.get("metadata") or {}
    labels: Mapping[str, str] = meta.get("labels") or {}
    selector: Mapping[str, str] = pod_spec.get("nodeSelector") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        return False
    affinity = (pod_spec.get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    name = meta.get("name") or ""
    return any(_term_matches(t, labels, name) for t in required.get("nodeSelectorTerms") or [])


# ---------------------------------------------------------------- one node


def node_ready(node: Obj) -> bool:
    """The node's Ready condition is True (False, Unknown or missing: not Ready)."""
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _resource_order(requests: Resources) -> list[str]:
    rest = sorted(set(requests) - set(_RESOURCE_ORDER))
    return [r for r in _RESOURCE_ORDER if r in requests] + rest


def insufficient(requests: Resources, allocatable: Resources, used: Resources) -> str | None:
    """NodeResourcesFit: each resource requested above 0 must fit in allocatable minus
    what the node's pods request; a resource the node does not list has 0. The first
    shortfall, as ``insufficient R: wants W, F free of A``; None when everything fits."""
    for name in _resource_order(requests):
        wants = requests[name]
        if wants <= 0:
            continue
        total = allocatable.get(name, 0)
        free = total - used.get(name, 0)
        if wants > free:
            return (
                f"insufficient {name}: wants {format_amount(name, wants)}, "
                f"{format_amount(name, max(free, 0))} free of {format_amount(name, total)}"
            )
    return None


def _fit(pod_spec: Obj, requests: Resources, node: Obj, used: Resources) -> str | None:
    meta, spec = node.get("metadata") or {}, node.get("spec") or {}
    tolerations = pod_spec.get("tolerations") or []
    if not node_ready(node):
        return "not Ready"
    pinned = pod_spec.get("nodeName")
    if pinned and pinned != meta.get("name"):
        return f"pod is pinned to node {pinned}"
    if spec.get("unschedulable") and not tolerates(tolerations, UNSCHEDULABLE_TAINT):
        return "cordoned"
    for taint in spec.get("taints") or []:
        if not tolerates(tolerations, taint):
            return f"taint {format_taint(taint)} not tolerated"
    if not matches_node_selector(pod_spec, node):
        return "nodeSelector/affinity does not match"
    allocatable = _to_base_units(_exact((node.get("status") or {}).get("allocatable")))
    return insufficient(requests, allocatable, used)


def node_fit(pod_spec: Obj, node: Obj, used: Resources) -> str | None:
    """None when one pod of ``pod_spec`` fits ``node`` whose pods already request ``used``;
    else the first reason it does not, checked in this order:

    - the Ready condition is True (stricter than the scheduler, which leaves NotReady
      nodes to their ``not-ready`` taint: a rank there would not run);
    - ``spec.nodeName``, when the pod sets it, is this node (NodeName);
    - ``spec.unschedulable`` (cordoned) counts as the ``node.kubernetes.io/unschedulable:
      NoSchedule`` taint, so a pod tolerating it fits (NodeUnschedulable);
    - every NoSchedule/NoExecute taint is tolerated (TaintToleration);
    - nodeSelector and required node affinity match (NodeAffinity);
    - every requested resource fits in allocatable minus ``used`` (NodeResourcesFit).
    """
    return _fit(pod_spec, pod_requests(pod_spec), node, used)


# ---------------------------------------------------------------- the cluster


@dataclasses.dataclass(frozen=True, slots=True)
class Capacity:
    """The nodes one rank fits (by name) and, for every other node, why not."""

    fits: tuple[str, ...]
    rejected: Mapping[str, str]  # node name -> reason, sorted by node name

    def summary(self, limit: int = 3) -> str:
        """``3 nodes fit; 2 rejected: gpu-1: insufficient ...; cpu-0: ...``."""
        head = "1 node fits" if len(self.fits) == 1 else f"{len(self.fits)} nodes fit"
        if not self.rejected:
            return head
        reasons = summarize_rejections(self.rejected, limit)
        return f"{head}; {len(self.rejected)} rejected: {reasons}"


def fitting_nodes(
    pod_spec: Obj,
    nodes: Iterable[Obj],
    pods: Iterable[Obj],
    *,
    exclude_pods_of: tuple[str, str] | None = None,
) -> Capacity:
    """Which ``nodes`` one pod of ``pod_spec`` fits, given every pod in the cluster
    (``pods``: what they request is taken from the nodes' allocatable). The pods of
    ``exclude_pods_of=(namespace, job)`` are not counted: a new attempt replaces them."""
    return fitting_nodes_with(pod_spec, nodes, used_by_pods(pods, exclude_pods_of=exclude_pods_of))


def fitting_nodes_with(
    pod_spec: Obj, nodes: Iterable[Obj], used: Mapping[str, Resources]
) -> Capacity:
    """``fitting_nodes`` given what is already requested on each node (the operator keeps
    these sums in a watch index instead of a list of every pod)."""
    requests = pod_requests(pod_spec)
    fits: list[str] = []
    rejected: dict[str, str] = {}
    for node in sorted(nodes, key=lambda n: (n.get("metadata") or {}).get("name") or ""):
        name = (node.get("metadata") or {}).get("name") or ""
        reason = _fit(pod_spec, requests, node, used.get(name, {}))
        if reason is None:
            fits.append(name)
        else:
            rejected[name] = reason
    return Capacity(tuple(fits), rejected)


def summarize_rejections(rejected: Mapping[str, str], limit: int = 3) -> str:
    """One line: the ``limit`` commonest reasons, each with its count and first nodes.

    ``gpu-1: taint x:NoSchedule not tolerated`` for one node, ``3 nodes (cpu-0, cpu-1,
    +1 more): insufficient ...`` for several; ``; +2 more reasons`` when cut short.
    """
    by_reason: dict[str, list[str]] = {}
    for node in sorted(rejected):
        by_reason.setdefault(rejected[node], []).append(node)
    ranked = sorted(by_reason, key=lambda r: (-len(by_reason[r]), by_reason[r][0]))
    parts = [_reason_group(reason, by_reason[reason]) for reason in ranked[:limit]]
    if len(ranked) > limit:
        more = len(ranked) - limit
        parts.append(f"+{more} more reason{'' if more == 1 else 's'}")
    return "; ".join(parts)


def _reason_group(reason: str, names: Sequence[str], shown: int = 2) -> str:
    if len(names) == 1:
        return f"{names[0]}: {reason}"
    listed = list(names[:shown]) + ([f"+{len(names) - shown} more"] if len(names) > shown else [])
    return f"{len(names)} nodes ({', '.join(listed)}): {reason}"
