"""On which nodes one rank fits, table-driven: kube-scheduler's filter rules, no cluster."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import pytest
from ctj_contract import LABEL_JOB
from ctj_operator import builders
from ctj_operator.capacity import (
    Capacity,
    fitting_nodes,
    matches_node_selector,
    node_fit,
    pod_requests,
    tolerates,
    toleration_matches,
    used_by_pods,
)
from ctj_operator.quantities import base_units, format_amount, parse_quantity
from ctj_operator.spec import JobSpec

Ki, Mi, Gi, Ti, Pi, Ei = (2**e for e in (10, 20, 30, 40, 50, 60))
GPU = "nvidia.com/gpu"
GPU_TAINT = {"key": GPU, "value": "present", "effect": "NoSchedule"}
TOLERATE_GPU = {"key": GPU, "operator": "Exists", "effect": "NoSchedule"}


def container(
    requests: dict[str, Any] | None = None,
    limits: dict[str, Any] | None = None,
    *,
    sidecar: bool = False,
) -> dict[str, Any]:
    c: dict[str, Any] = {"name": "c", "image": "x", "resources": {}}
    if requests is not None:
        c["resources"]["requests"] = requests
    if limits is not None:
        c["resources"]["limits"] = limits
    if sidecar:
        c["restartPolicy"] = "Always"
    return c


def pod_spec(
    *containers: dict[str, Any], init: tuple[dict[str, Any], ...] = (), **extra: Any
) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers) or [container()]}
    if init:
        spec["initContainers"] = list(init)
    spec.update(extra)
    return spec


def node(
    name: str,
    *,
    cpu: str = "16",
    memory: str = "64Gi",
    pods: str = "110",
    gpus: int | None = None,
    labels: dict[str, str] | None = None,
    taints: list[dict[str, Any]] | None = None,
    ready: str | None = "True",
    unschedulable: bool = False,
) -> dict[str, Any]:
    allocatable = {"cpu": cpu, "memory": memory, "pods": pods}
    if gpus is not None:
        allocatable[GPU] = str(gpus)
    spec: dict[str, Any] = {}
    if taints:
        spec["taints"] = taints
    if unschedulable:
        spec["unschedulable"] = True
    conditions = [{"type": "MemoryPressure", "status": "False"}]
    if ready is not None:
        conditions.append({"type": "Ready", "status": ready})
    return {
        "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, **(labels or {})}},
        "spec": spec,
        "status": {"allocatable": allocatable, "conditions": conditions},
    }


def gpu_node(name: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        cpu="96", memory="1Ti", gpus=8, labels={"pool": "gpu"}, taints=[GPU_TAINT]
    )
    base.update(kw)
    return node(name, **base)


def pod(
    node_name: str | None,
    spec: dict[str, Any],
    *,
    phase: str = "Running",
    namespace: str = "ml",
    job: str | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": f"p-{node_name}", "namespace": namespace, "labels": {}}
    if job is not None:
        meta["labels"][LABEL_JOB] = job
    if deleting:
        meta["deletionTimestamp"] = "2024-01-01T00:00:00Z"
    return {
        "metadata": meta,
        "spec": dict(spec, nodeName=node_name) if node_name else spec,
        "status": {"phase": phase},
    }


# a rank of a GPU job: one GPU (limits only, as people write it), 8 cpu, 64Gi
GPU_RANK = pod_spec(container({"cpu": "8", "memory": "64Gi"}, {GPU: 1}), tolerations=[TOLERATE_GPU])
CPU_RANK = pod_spec(container({"cpu": "4", "memory": "16Gi"}))


# ---------------------------------------------------------------- quantities


@pytest.mark.parametrize(
    ("quantity", "want"),
    [
        pytest.param("2", 2, id="plain integer"),
        pytest.param("1.5", Fraction(3, 2), id="decimal fraction"),
        pytest.param(".5", Fraction(1, 2), id="leading dot"),
        pytest.param("1.", 1, id="trailing dot"),
        pytest.param("+3", 3, id="explicit plus sign"),
        pytest.param("-3", -3, id="negative"),
        pytest.param("007", 7, id="leading zeros"),
        pytest.param("100m", Fraction(1, 10), id="m is milli"),
        pytest.param("250u", Fraction(1, 4000), id="u is micro"),
        pytest.param("5n", Fraction(5, 10**9), id="n is nano"),
        pytest.param("1k", 1000, id="k is kilo (lowercase)"),
        pytest.param("1M", 10**6, id="M is mega"),
        pytest.param("1G", 10**9, id="G is giga, decimal"),
        pytest.param("1T", 10**12, id="T is tera"),
        pytest.param("1P", 10**15, id="P is peta"),
        pytest.param("1E", 10**18, id="a bare E is exa"),
        pytest.param("1Ki", Ki, id="Ki is 1024"),
        pytest.param("512Mi", 512 * Mi, id="Mi"),
        pytest.param("1Gi", Gi, id="Gi, binary"),
        pytest.param("2Ti", 2 * Ti, id="Ti"),
        pytest.param("1Pi", Pi, id="Pi"),
        pytest.param("7Ei", 7 * Ei, id="Ei"),
        pytest.param("1.5Gi", 3 * Gi // 2, id="fraction with a binary suffix"),
        pytest.param("1e3", 1000, id="e exponent"),
        pytest.param("1E3", 1000, id="E followed by digits is an exponent"),
        pytest.param("5e-1", Fraction(1, 2), id="negative exponent"),
        pytest.param("1.5e+2", 150, id="fraction and signed exponent"),
        pytest.param("0.0000000001", Fraction(1, 10**9), id="below a nano rounds up to 1n"),
        pytest.param("1.0000000001", 1 + Fraction(1, 10**9), id="rounds up at the ninth decimal"),
        pytest.param("1e-99999", Fraction(1, 10**9), id="tiny exponent rounds up to 1n"),
        pytest.param("0e99999999999", 0, id="zero with any exponent is zero"),
        pytest.param("-0", 0, id="minus zero is zero"),
        pytest.param(7, 7, id="int"),
        pytest.param(0.25, Fraction(1, 4), id="float"),
    ],
)
def test_quantities(quantity: str | int | float, want: int | Fraction) -> None:
    got = parse_quantity(quantity)
    assert got == want
    assert type(got) is type(want), "whole values come back as int"


@pytest.mark.parametrize(
    ("resource", "quantity", "want"),
    [
        pytest.param("cpu", "100m", 100, id="cpu in millicores"),
        pytest.param("cpu", "1.5", 1500, id="cpu cores to millicores"),
        pytest.param("cpu", "0.0005", 1, id="cpu rounds up to a whole millicore"),
        pytest.param("cpu", "1001u", 2, id="cpu micro rounds up"),
        pytest.param("memory", "1Gi", Gi, id="memory in bytes"),
        pytest.param("memory", "1.5", 2, id="memory rounds up to a whole byte"),
        pytest.param("memory", "129M", 129 * 10**6, id="decimal memory"),
        pytest.param("ephemeral-storage", "10Gi", 10 * Gi, id="ephemeral-storage in bytes"),
        pytest.param(GPU, "8", 8, id="extended resource as a count"),
        pytest.param("pods", 110, 110, id="pods as a count"),
    ],
)
def test_base_units(resource: str, quantity: str | int, want: int) -> None:
    assert base_units(resource, quantity) == want


@pytest.mark.parametrize(
    "quantity",
    [
        pytest.param("", id="empty"),
        pytest.param(".", id="dot alone"),
        pytest.param("+", id="sign alone"),
        pytest.param("Gi", id="suffix alone"),
        pytest.param("1K", id="uppercase K is not a suffix"),
        pytest.param("1ki", id="lowercase ki is not a suffix"),
        pytest.param("1mi", id="mi is not a suffix"),
        pytest.param("1e", id="e without an exponent"),
        pytest.param("1e1.5", id="fractional exponent"),
        pytest.param(" 1", id="leading space"),
        pytest.param("1 ", id="trailing space"),
        pytest.param("1 Gi", id="space before the suffix"),
        pytest.param("1.5.5", id="two dots"),
        pytest.param("--1", id="two signs"),
        pytest.param("1GiB", id="unit after the suffix"),
        pytest.param("0x10", id="hex"),
        pytest.param("1_000", id="underscores"),
        pytest.param("١", id="non-ASCII digit"),
        pytest.param("1e30", id="beyond int64"),
        pytest.param("8Ei", id="binary beyond int64"),
        pytest.param("1e99999999999999", id="huge exponent"),
        pytest.param(float("nan"), id="nan"),
        pytest.param(float("inf"), id="inf"),
        pytest.param(True, id="bool"),
        pytest.param(None, id="None"),
    ],
)
def test_malformed_quantities_raise_naming_them(quantity: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(quantity))):
        parse_quantity(quantity)


@pytest.mark.parametrize(
    ("resource", "amount", "want"),
    [
        pytest.param("cpu", 1500, "1500m", id="cpu millicores"),
        pytest.param("cpu", 8000, "8", id="whole cpus"),
        pytest.param("memory", 64 * Gi, "64Gi", id="memory in the largest exact binary unit"),
        pytest.param("memory", 1000, "1000", id="memory in bytes when no unit divides"),
        pytest.param("memory", 0, "0", id="no memory"),
        pytest.param("hugepages-2Mi", 4 * Mi, "4Mi", id="hugepages in bytes"),
        pytest.param(GPU, 8, "8", id="a count"),
    ],
)
def test_format_amount(resource: str, amount: int, want: str) -> None:
    assert format_amount(resource, amount) == want


# ---------------------------------------------------------------- effective requests


@pytest.mark.parametrize(
    ("spec", "want"),
    [
        pytest.param(pod_spec(container()), {"pods": 1}, id="no requests: only the pod slot"),
        pytest.param(
            pod_spec(container({"cpu": "1", "memory": "1Gi"})),
            {"cpu": 1000, "memory": Gi, "pods": 1},
            id="one container",
        ),
        pytest.param(
            pod_spec(container({"cpu": "1"}), container({"cpu": "500m", "memory": "1Gi"})),
            {"cpu": 1500, "memory": Gi, "pods": 1},
            id="containers add up",
        ),
        pytest.param(
            pod_spec(container(limits={"cpu": "2", GPU: "1"})),
            {"cpu": 2000, GPU: 1, "pods": 1},
            id="limits without requests are the requests",
        ),
        pytest.param(
            pod_spec(container({"cpu": "1"}, {"cpu": "4", "memory": "2Gi"})),
            {"cpu": 1000, "memory": 2 * Gi, "pods": 1},
            id="limits default only the resources without a request",
        ),
        pytest.param(
            pod_spec(container({"cpu": "1"}), init=(container({"cpu": "1"}, sidecar=True),)),
            {"cpu": 2000, "pods": 1},
            id="a sidecar init container adds to the containers",
        ),
        pytest.param(
            pod_spec(container({"cpu": "1"}), init=(container({"cpu": "3", "memory": "1Gi"}),)),
            {"cpu": 3000, "memory": Gi, "pods": 1},
            id="a plain init container larger than the containers sets the request",
        ),
        pytest.param(
            pod_spec(container({"cpu": "4"}), init=(container({"cpu": "3"}),)),
            {"cpu": 4000, "pods": 1},
            id="a plain init container smaller than the containers changes nothing",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "1"}), init=(container({"cpu": "2"}), container({"cpu": "3"}))
            ),
            {"cpu": 3000, "pods": 1},
            id="plain init containers run one at a time: max, not sum",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "1"}),
                init=(container({"cpu": "1"}, sidecar=True), container({"cpu": "2500m"})),
            ),
            {"cpu": 3500, "pods": 1},
            id="a plain init container after a sidecar runs alongside it",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "1"}),
                init=(container({"cpu": "2500m"}), container({"cpu": "1"}, sidecar=True)),
            ),
            {"cpu": 2500, "pods": 1},
            id="a plain init container before a sidecar runs without it",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "4", "memory": "1Gi"}),
                init=(container({"cpu": "1", "memory": "8Gi"}),),
            ),
            {"cpu": 4000, "memory": 8 * Gi, "pods": 1},
            id="the max is taken per resource",
        ),
        pytest.param(
            pod_spec(container({"cpu": "1"}), overhead={"cpu": "250m", "memory": "120Mi"}),
            {"cpu": 1250, "memory": 120 * Mi, "pods": 1},
            id="pod overhead is added",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "1"}),
                init=(container({"cpu": "3"}),),
                overhead={"cpu": "250m"},
            ),
            {"cpu": 3250, "pods": 1},
            id="overhead is added after the init containers' max",
        ),
        pytest.param(
            pod_spec(
                container({"cpu": "1", GPU: "1"}),
                resources={"requests": {"cpu": "6", "memory": "4Gi", GPU: "2"}},
            ),
            {"cpu": 6000, "memory": 4 * Gi, GPU: 1, "pods": 1},
            id="pod-level requests replace cpu and memory only",
        ),
        pytest.param(
            pod_spec(container({"memory": "0.5"}), container({"memory": "0.5"})),
            {"memory": 1, "pods": 1},
            id="summed exactly, rounded once",
        ),
        pytest.param(
            pod_spec(container({GPU: "0"})),
            {GPU: 0, "pods": 1},
            id="a zero request is kept",
        ),
    ],
)
def test_effective_requests(spec: dict[str, Any], want: dict[str, int]) -> None:
    assert pod_requests(spec) == want


def test_a_rank_built_by_the_operator_counts_its_checkpoint_sidecar() -> None:
    template = {"spec": {"containers": [container({"cpu": "8"}, {GPU: "1"})]}}
    spec = JobSpec.parse(
        {
            "replicas": 2,
            "template": template,
            "checkpoint": {
                "uri": "s3://b/p",
                "sidecarResources": {"requests": {"cpu": "500m", "memory": "1Gi"}},
            },
        }
    )
    body = {"metadata": {"name": "demo", "namespace": "ml", "uid": "u"}}
    rank = builders.build_pod(body, spec, uri="s3://b/p/x", attempt=1, world_size=2, node_rank=0)
    assert pod_requests(rank["spec"]) == {"cpu": 8500, "memory": Gi, GPU: 1, "pods": 1}


def test_a_malformed_request_raises_naming_it() -> None:
    with pytest.raises(ValueError, match="'lots'"):
        pod_requests(pod_spec(container({"cpu": "lots"})))


# ---------------------------------------------------------------- tolerations

NO_SCHEDULE = {"key": "k", "value": "v", "effect": "NoSchedule"}
NO_EXECUTE = {"key": "k", "value": "v", "effect": "NoExecute"}
PREFER = {"key": "k", "value": "v", "effect": "PreferNoSchedule"}
NO_VALUE = {"key": "k", "effect": "NoSchedule"}


@pytest.mark.parametrize(
    ("toleration", "taint", "want"),
    [
        pytest.param(
            {"key": "k", "operator": "Equal", "value": "v", "effect": "NoSchedule"},
            NO_SCHEDULE,
            True,
            id="Equal: same key, value and effect",
        ),
        pytest.param(
            {"key": "k", "operator": "Equal", "value": "w", "effect": "NoSchedule"},
            NO_SCHEDULE,
            False,
            id="Equal: another value",
        ),
        pytest.param(
            {"key": "k", "value": "v", "effect": "NoSchedule"},
            NO_SCHEDULE,
            True,
            id="no operator means Equal",
        ),
        pytest.param(
            {"key": "k", "value": "w"}, NO_SCHEDULE, False, id="no operator compares the value"
        ),
        pytest.param(
            {"key": "k", "operator": "Equal", "effect": "NoSchedule"},
            NO_VALUE,
            True,
            id="Equal: no value matches a taint without one",
        ),
        pytest.param(
            {"key": "k", "operator": "Equal", "effect": "NoSchedule"},
            NO_SCHEDULE,
            False,
            id="Equal: no value does not match a taint with one",
        ),
        pytest.param(
            {"key": "j", "operator": "Equal", "value": "v"},
            NO_SCHEDULE,
            False,
            id="Equal: another key",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoSchedule"},
            NO_SCHEDULE,
            True,
            id="Exists: any value",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "value": "ignored"},
            NO_SCHEDULE,
            True,
            id="Exists ignores the toleration's value",
        ),
        pytest.param(
            {"key": "j", "operator": "Exists"}, NO_SCHEDULE, False, id="Exists: another key"
        ),
        pytest.param({"operator": "Exists"}, NO_SCHEDULE, True, id="empty key Exists: NoSchedule"),
        pytest.param({"operator": "Exists"}, NO_EXECUTE, True, id="empty key Exists: NoExecute"),
        pytest.param(
            {"operator": "Exists"}, GPU_TAINT, True, id="empty key Exists: any key and value"
        ),
        pytest.param(
            {"key": "", "operator": "Exists", "effect": "NoExecute"},
            NO_SCHEDULE,
            False,
            id="empty key Exists with an effect: that effect only",
        ),
        pytest.param(
            {"operator": "Equal", "value": "v"},
            NO_SCHEDULE,
            True,
            id="empty key Equal compares the value alone (API validation forbids it)",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists"}, NO_EXECUTE, True, id="empty effect: NoExecute"
        ),
        pytest.param(
            {"key": "k", "operator": "Exists"}, PREFER, True, id="empty effect: PreferNoSchedule"
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoExecute"},
            NO_SCHEDULE,
            False,
            id="NoExecute toleration vs NoSchedule taint",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoSchedule"},
            NO_EXECUTE,
            False,
            id="NoSchedule toleration vs NoExecute taint",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoSchedule"},
            PREFER,
            False,
            id="NoSchedule toleration vs PreferNoSchedule taint",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 30},
            NO_EXECUTE,
            True,
            id="tolerationSeconds is irrelevant to scheduling",
        ),
        pytest.param(
            {"key": "k", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 0},
            NO_EXECUTE,
            True,
            id="tolerationSeconds 0 still tolerates at scheduling",
        ),
        pytest.param(
            {"key": "k", "operator": "Gt", "value": "3"},
            {"key": "k", "value": "5", "effect": "NoSchedule"},
            True,
            id="Gt: taint value above",
        ),
        pytest.param(
            {"key": "k", "operator": "Gt", "value": "5"},
            {"key": "k", "value": "5", "effect": "NoSchedule"},
            False,
            id="Gt: equal is not above",
        ),
        pytest.param(
            {"key": "k", "operator": "Lt", "value": "3"},
            {"key": "k", "value": "1", "effect": "NoSchedule"},
            True,
            id="Lt: taint value below",
        ),
        pytest.param(
            {"key": "k", "operator": "Lt", "value": "3"},
            {"key": "k", "value": "x", "effect": "NoSchedule"},
            False,
            id="Lt: a non-integer taint value never matches",
        ),
        pytest.param(
            {"key": "k", "operator": "In", "value": "v"},
            NO_SCHEDULE,
            False,
            id="an unknown operator never matches",
        ),
    ],
)
def test_toleration_matches(toleration: dict[str, Any], taint: dict[str, Any], want: bool) -> None:
    assert toleration_matches(toleration, taint) is want


@pytest.mark.parametrize(
    ("tolerations", "taint", "want"),
    [
        pytest.param([], NO_SCHEDULE, False, id="NoSchedule blocks without a toleration"),
        pytest.param(None, NO_EXECUTE, False, id="NoExecute blocks without a toleration"),
        pytest.param([], PREFER, True, id="PreferNoSchedule never blocks"),
        pytest.param(
            [{"key": "other", "operator": "Exists"}, {"key": "k", "operator": "Exists"}],
            NO_SCHEDULE,
            True,
            id="any one matching toleration suffices",
        ),
        pytest.param(
            [{"key": "other", "operator": "Exists"}],
            NO_SCHEDULE,
            False,
            id="tolerations of other keys do not help",
        ),
    ],
)
def test_tolerates(
    tolerations: list[dict[str, Any]] | None, taint: dict[str, Any], want: bool
) -> None:
    assert tolerates(tolerations, taint) is want


# ---------------------------------------------------------------- nodeSelector and affinity

LABELED = node("gpu-1", labels={"pool": "gpu", "gpu-count": "8", "zone": "a"})


def required(*terms: dict[str, Any]) -> dict[str, Any]:
    return {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": list(terms)}
            }
        }
    }


def expr(key: str, operator: str, *values: str) -> dict[str, Any]:
    e: dict[str, Any] = {"key": key, "operator": operator}
    if values:
        e["values"] = list(values)
    return e


def term(*expressions: dict[str, Any], fields: tuple[dict[str, Any], ...] = ()) -> dict[str, Any]:
    t: dict[str, Any] = {}
    if expressions:
        t["matchExpressions"] = list(expressions)
    if fields:
        t["matchFields"] = list(fields)
    return t


NAME = "metadata.name"


@pytest.mark.parametrize(
    ("extra", "want"),
    [
        pytest.param({}, True, id="no selector matches every node"),
        pytest.param({"nodeSelector": {"pool": "gpu"}}, True, id="nodeSelector label equal"),
        pytest.param({"nodeSelector": {"pool": "cpu"}}, False, id="nodeSelector label differs"),
        pytest.param({"nodeSelector": {"rack": "r1"}}, False, id="nodeSelector label missing"),
        pytest.param(
            {"nodeSelector": {"pool": "gpu", "zone": "b"}},
            False,
            id="nodeSelector needs every label",
        ),
        pytest.param(required(term(expr("pool", "In", "cpu", "gpu"))), True, id="In: one of"),
        pytest.param(required(term(expr("pool", "In", "cpu"))), False, id="In: none of"),
        pytest.param(required(term(expr("rack", "In", "r1"))), False, id="In: label missing"),
        pytest.param(required(term(expr("pool", "NotIn", "cpu"))), True, id="NotIn: not one of"),
        pytest.param(required(term(expr("pool", "NotIn", "gpu"))), False, id="NotIn: one of"),
        pytest.param(
            required(term(expr("rack", "NotIn", "r1"))), True, id="NotIn: a missing label matches"
        ),
        pytest.param(required(term(expr("zone", "Exists"))), True, id="Exists: label present"),
        pytest.param(required(term(expr("rack", "Exists"))), False, id="Exists: label missing"),
        pytest.param(
            required(term(expr("rack", "DoesNotExist"))), True, id="DoesNotExist: label missing"
        ),
        pytest.param(
            required(term(expr("zone", "DoesNotExist"))), False, id="DoesNotExist: label present"
        ),
        pytest.param(required(term(expr("gpu-count", "Gt", "4"))), True, id="Gt: above"),
        pytest.param(required(term(expr("gpu-count", "Gt", "8"))), False, id="Gt: equal"),
        pytest.param(required(term(expr("gpu-count", "Lt", "16"))), True, id="Lt: below"),
        pytest.param(required(term(expr("gpu-count", "Lt", "8"))), False, id="Lt: equal"),
        pytest.param(
            required(term(expr("gpu-count", "Gt", "+7"))), True, id="Gt: a signed integer value"
        ),
        pytest.param(
            required(term(expr("gpu-count", "Gt", "4.5"))),
            False,
            id="Gt with a non-integer value is invalid: matches nothing",
        ),
        pytest.param(
            required(term(expr("gpu-count", "Lt", "1e3"))),
            False,
            id="Lt with an exponent is not an integer",
        ),
        pytest.param(
            required(term(expr("zone", "Gt", "1"))),
            False,
            id="Gt on a non-integer label never matches",
        ),
        pytest.param(
            required(term(expr("rack", "Lt", "1"))), False, id="Lt on a missing label never matches"
        ),
        pytest.param(
            required(term(expr("gpu-count", "Gt", "1", "2"))),
            False,
            id="Gt with two values is invalid",
        ),
        pytest.param(required(term(expr("pool", "In"))), False, id="In without values is invalid"),
        pytest.param(
            required(term(expr("zone", "Exists", "a"))), False, id="Exists with values is invalid"
        ),
        pytest.param(
            required(term(expr("pool", "Like", "g*"))), False, id="an unknown operator is invalid"
        ),
        pytest.param(
            required(term(expr("pool", "In", "gpu"), expr("zone", "In", "b"))),
            False,
            id="expressions of a term are ANDed",
        ),
        pytest.param(
            required(term(expr("pool", "In", "cpu")), term(expr("zone", "In", "a"))),
            True,
            id="terms are ORed",
        ),
        pytest.param(
            required(term(expr("pool", "Gt", "x")), term(expr("zone", "In", "a"))),
            True,
            id="an invalid term does not spoil the others",
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "In", "gpu-1"),))), True, id="matchFields In"
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "In", "gpu-2"),))), False, id="matchFields In: other"
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "NotIn", "gpu-1"),))), False, id="matchFields NotIn"
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "NotIn", "gpu-2"),))),
            True,
            id="matchFields NotIn: other",
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "In", "gpu-1", "gpu-2"),))),
            False,
            id="matchFields with two values is invalid",
        ),
        pytest.param(
            required(term(fields=(expr("spec.unschedulable", "In", "false"),))),
            False,
            id="matchFields on another field is invalid",
        ),
        pytest.param(
            required(term(fields=(expr(NAME, "Exists"),))),
            False,
            id="matchFields Exists is invalid",
        ),
        pytest.param(
            required(term(expr("pool", "In", "gpu"), fields=(expr(NAME, "In", "gpu-2"),))),
            False,
            id="matchFields and matchExpressions of a term are ANDed",
        ),
        pytest.param(required(), False, id="no terms match nothing"),
        pytest.param(required(term()), False, id="an empty term matches nothing"),
        pytest.param(
            required(term(), term(expr("pool", "Exists"))),
            True,
            id="an empty term is skipped among others",
        ),
        pytest.param(
            {"nodeSelector": {"pool": "cpu"}, **required(term(expr("pool", "Exists")))},
            False,
            id="nodeSelector and affinity must both match",
        ),
        pytest.param(
            {
                "affinity": {
                    "nodeAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 1, "preference": term(expr("pool", "In", "cpu"))}
                        ]
                    }
                }
            },
            True,
            id="preferred affinity is ignored",
        ),
        pytest.param(
            {
                "affinity": {
                    "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": []}
                }
            },
            True,
            id="pod anti-affinity is not node affinity",
        ),
    ],
)
def test_node_selector_and_affinity(extra: dict[str, Any], want: bool) -> None:
    assert matches_node_selector(pod_spec(**extra), LABELED) is want


# ---------------------------------------------------------------- one node


def gpus_used(n: int) -> dict[str, int]:
    return {GPU: n, "pods": n}


@pytest.mark.parametrize(
    ("spec", "the_node", "used", "want"),
    [
        pytest.param(GPU_RANK, gpu_node("g"), {}, None, id="GPU pool tainted and tolerated"),
        pytest.param(
            pod_spec(container(limits={GPU: "1"})),
            gpu_node("g"),
            {},
            "taint nvidia.com/gpu=present:NoSchedule not tolerated",
            id="GPU pool tainted, not tolerated",
        ),
        pytest.param(
            pod_spec(
                container(limits={GPU: "1"}),
                tolerations=[{"key": GPU, "operator": "Equal", "value": "present"}],
            ),
            gpu_node("g"),
            {},
            None,
            id="GPU taint tolerated with Equal on its value",
        ),
        pytest.param(
            GPU_RANK,
            node("c"),
            {},
            "insufficient nvidia.com/gpu: wants 1, 0 free of 0",
            id="a CPU node does not list nvidia.com/gpu: 0 free",
        ),
        pytest.param(
            GPU_RANK,
            gpu_node("g"),
            gpus_used(8),
            "insufficient nvidia.com/gpu: wants 1, 0 free of 8",
            id="every GPU taken by other pods",
        ),
        pytest.param(GPU_RANK, gpu_node("g"), gpus_used(7), None, id="the last GPU free"),
        pytest.param(
            CPU_RANK,
            node("c"),
            {"memory": 60 * Gi, "pods": 3},
            "insufficient memory: wants 16Gi, 4Gi free of 64Gi",
            id="memory exhausted by other pods",
        ),
        pytest.param(
            CPU_RANK,
            node("c"),
            {"cpu": 12001},
            "insufficient cpu: wants 4, 3999m free of 16",
            id="cpu short by one millicore",
        ),
        pytest.param(CPU_RANK, node("c"), {"cpu": 12000}, None, id="cpu exactly enough"),
        pytest.param(
            CPU_RANK,
            node("c"),
            {"pods": 110},
            "insufficient pods: wants 1, 0 free of 110",
            id="no pod slot left",
        ),
        pytest.param(
            pod_spec(container({"ephemeral-storage": "20Gi"})),
            node("c"),
            {},
            "insufficient ephemeral-storage: wants 20Gi, 0 free of 0",
            id="a node that lists no ephemeral-storage has none",
        ),
        pytest.param(
            pod_spec(container({GPU: "0", "cpu": "0"})),
            node("c"),
            {"cpu": 99000},
            None,
            id="requests of 0 always fit, even on an overcommitted node",
        ),
        pytest.param(
            CPU_RANK,
            node("c", cpu="2"),
            {"cpu": 3000},
            "insufficient cpu: wants 4, 0 free of 2",
            id="an overcommitted node shows 0 free",
        ),
        pytest.param(
            CPU_RANK,
            node("c", cpu="2", memory="1Gi"),
            {},
            "insufficient cpu: wants 4, 2 free of 2",
            id="the first shortfall is reported: cpu before memory",
        ),
        pytest.param(
            CPU_RANK,
            node("c", unschedulable=True, taints=[]),
            {},
            "cordoned",
            id="cordoned",
        ),
        pytest.param(
            dict(
                CPU_RANK,
                tolerations=[{"key": "node.kubernetes.io/unschedulable", "operator": "Exists"}],
            ),
            node("c", unschedulable=True),
            {},
            None,
            id="cordoned but the unschedulable taint is tolerated",
        ),
        pytest.param(
            dict(CPU_RANK, tolerations=[{"operator": "Exists"}]),
            node("c", unschedulable=True),
            {},
            None,
            id="tolerate-everything also tolerates cordoning",
        ),
        pytest.param(CPU_RANK, node("c", ready="False"), {}, "not Ready", id="NotReady"),
        pytest.param(CPU_RANK, node("c", ready="Unknown"), {}, "not Ready", id="Ready Unknown"),
        pytest.param(CPU_RANK, node("c", ready=None), {}, "not Ready", id="no Ready condition"),
        pytest.param(
            dict(CPU_RANK, tolerations=[{"operator": "Exists"}]),
            node("c", ready="False"),
            {},
            "not Ready",
            id="NotReady even when every taint is tolerated",
        ),
        pytest.param(
            CPU_RANK,
            node("c", taints=[{"key": "spot", "effect": "PreferNoSchedule"}]),
            {},
            None,
            id="a PreferNoSchedule taint does not block",
        ),
        pytest.param(
            CPU_RANK,
            node("c", taints=[{"key": "maintenance", "effect": "NoExecute"}]),
            {},
            "taint maintenance:NoExecute not tolerated",
            id="a NoExecute taint blocks",
        ),
        pytest.param(
            dict(CPU_RANK, nodeSelector={"pool": "gpu"}),
            node("c", labels={"pool": "cpu"}),
            {},
            "nodeSelector/affinity does not match",
            id="nodeSelector does not match",
        ),
        pytest.param(
            dict(CPU_RANK, nodeName="other"),
            node("c"),
            {},
            "pod is pinned to node other",
            id="spec.nodeName names another node",
        ),
    ],
)
def test_node_fit(
    spec: dict[str, Any], the_node: dict[str, Any], used: dict[str, int], want: str | None
) -> None:
    assert node_fit(spec, the_node, used) == want


# ---------------------------------------------------------------- what the nodes' pods use


def test_used_by_pods_sums_the_live_pods_bound_to_each_node() -> None:
    two_cpus = pod_spec(container({"cpu": "2"}))
    one_gpu = pod_spec(container(limits={GPU: "1"}))
    pods = [
        pod("n1", two_cpus),
        pod("n1", one_gpu, phase="Pending"),  # bound, not started: holds its requests
        pod("n1", two_cpus, deleting=True),  # terminating still holds them
        pod("n1", two_cpus, phase="Succeeded"),
        pod("n1", two_cpus, phase="Failed"),
        pod(None, two_cpus, phase="Pending"),  # not bound yet
        pod("n2", one_gpu),
    ]
    assert used_by_pods(pods) == {
        "n1": {"cpu": 4000, GPU: 1, "pods": 3},
        "n2": {GPU: 1, "pods": 1},
    }


def test_used_by_pods_can_leave_out_one_jobs_pods() -> None:
    gpu = pod_spec(container(limits={GPU: "1"}))
    pods = [
        pod("n1", gpu, job="demo"),
        pod("n1", gpu, job="demo", namespace="other"),  # same name, another namespace
        pod("n1", gpu, job="other"),
        pod("n1", gpu),
    ]
    assert used_by_pods(pods, exclude_pods_of=("ml", "demo")) == {"n1": {GPU: 3, "pods": 3}}


# ---------------------------------------------------------------- small clusters


def gpu_pods(node_name: str, n: int, **kw: Any) -> list[dict[str, Any]]:
    return [pod(node_name, pod_spec(container(limits={GPU: "1"})), **kw) for _ in range(n)]


MIXED = [gpu_node("gpu-0"), gpu_node("gpu-1"), gpu_node("gpu-2"), node("cpu-0"), node("cpu-1")]


@pytest.mark.parametrize(
    ("spec", "nodes", "pods", "exclude", "want"),
    [
        pytest.param(
            GPU_RANK,
            MIXED,
            [],
            None,
            ["gpu-0", "gpu-1", "gpu-2"],
            id="a tolerating GPU rank fits the tainted pool, not the CPU nodes",
        ),
        pytest.param(
            pod_spec(container(limits={GPU: "1"})),
            MIXED,
            [],
            None,
            [],
            id="a GPU rank without the toleration fits nowhere",
        ),
        pytest.param(
            CPU_RANK,
            MIXED,
            [],
            None,
            ["cpu-0", "cpu-1"],
            id="a CPU rank stays off the tainted GPU pool",
        ),
        pytest.param(
            dict(CPU_RANK, tolerations=[TOLERATE_GPU]),
            MIXED,
            [],
            None,
            ["cpu-0", "cpu-1", "gpu-0", "gpu-1", "gpu-2"],
            id="a tolerating CPU rank fits everywhere, sorted by name",
        ),
        pytest.param(
            GPU_RANK,
            MIXED,
            gpu_pods("gpu-1", 8, job="other"),
            ("ml", "demo"),
            ["gpu-0", "gpu-2"],
            id="a GPU node filled by another job does not count",
        ),
        pytest.param(
            GPU_RANK,
            MIXED,
            gpu_pods("gpu-1", 8, job="demo"),
            ("ml", "demo"),
            ["gpu-0", "gpu-1", "gpu-2"],
            id="the job's own pods do not count against it",
        ),
        pytest.param(
            GPU_RANK,
            MIXED,
            gpu_pods("gpu-1", 8, job="demo", phase="Failed"),
            None,
            ["gpu-0", "gpu-1", "gpu-2"],
            id="finished pods free their GPUs",
        ),
        pytest.param(
            GPU_RANK,
            [
                gpu_node("gpu-0"),
                gpu_node("gpu-1", ready="False"),
                gpu_node("gpu-2", unschedulable=True),
                gpu_node("gpu-3", memory="32Gi"),
            ],
            [],
            None,
            ["gpu-0"],
            id="NotReady, cordoned and too small nodes do not count",
        ),
        pytest.param(
            dict(GPU_RANK, nodeSelector={"gpu": "h100"}),
            [
                gpu_node("a100-0", labels={"gpu": "a100"}),
                gpu_node("h100-0", labels={"gpu": "h100"}),
                gpu_node("h100-1", labels={"gpu": "h100"}),
            ],
            [],
            None,
            ["h100-0", "h100-1"],
            id="nodeSelector picks the GPU model",
        ),
        pytest.param(
            dict(GPU_RANK, **required(term(expr("zone", "In", "a", "b")))),
            [
                gpu_node("g-a", labels={"zone": "a"}),
                gpu_node("g-b", labels={"zone": "b"}),
                gpu_node("g-c", labels={"zone": "c"}),
            ],
            [],
            None,
            ["g-a", "g-b"],
            id="required node affinity picks the zones",
        ),
        pytest.param(CPU_RANK, [], [], None, [], id="no nodes, no capacity"),
    ],
)
def test_small_clusters(
    spec: dict[str, Any],
    nodes: list[dict[str, Any]],
    pods: list[dict[str, Any]],
    exclude: tuple[str, str] | None,
    want: list[str],
) -> None:
    capacity = fitting_nodes(spec, nodes, pods, exclude_pods_of=exclude)
    assert list(capacity.fits) == want
    names = sorted(n["metadata"]["name"] for n in nodes)
    assert sorted([*capacity.fits, *capacity.rejected]) == names, "every node fits or says why"
    assert list(capacity.rejected) == sorted(capacity.rejected)


def test_rejections_say_why() -> None:
    nodes = [*MIXED, gpu_node("gpu-3", ready="False")]
    capacity = fitting_nodes(GPU_RANK, nodes, gpu_pods("gpu-1", 8))
    assert capacity.fits == ("gpu-0", "gpu-2")
    assert capacity.rejected == {
        "cpu-0": "insufficient nvidia.com/gpu: wants 1, 0 free of 0",
        "cpu-1": "insufficient nvidia.com/gpu: wants 1, 0 free of 0",
        "gpu-1": "insufficient nvidia.com/gpu: wants 1, 0 free of 8",
        "gpu-3": "not Ready",
    }
    assert capacity.summary() == (
        "2 nodes fit; 4 rejected: "
        "2 nodes (cpu-0, cpu-1): insufficient nvidia.com/gpu: wants 1, 0 free of 0; "
        "gpu-1: insufficient nvidia.com/gpu: wants 1, 0 free of 8; "
        "gpu-3: not Ready"
    )


@pytest.mark.parametrize(
    ("capacity", "limit", "want"),
    [
        pytest.param(Capacity(("a", "b", "c"), {}), 3, "3 nodes fit", id="nothing rejected"),
        pytest.param(
            Capacity(("a",), {"b": "cordoned"}),
            3,
            "1 node fits; 1 rejected: b: cordoned",
            id="one of each",
        ),
        pytest.param(
            Capacity((), {f"n{i}": "not Ready" for i in range(5)}),
            3,
            "0 nodes fit; 5 rejected: 5 nodes (n0, n1, +3 more): not Ready",
            id="many nodes of one reason are counted, the first named",
        ),
        pytest.param(
            Capacity(
                (),
                {"a": "cordoned", "b": "not Ready", "c": "not Ready", "d": "x", "e": "y"},
            ),
            2,
            "0 nodes fit; 5 rejected: 2 nodes (b, c): not Ready; a: cordoned; +2 more reasons",
            id="the commonest reasons first, the rest counted",
        ),
    ],
)
def test_summary(capacity: Capacity, limit: int, want: str) -> None:
    assert capacity.summary(limit) == want
