"""Names that always fit (operator/ctj_operator/names.py): every object the operator makes
for the longest name the CRD admits, at the last attempt and the largest rank, meets
Kubernetes' rules for its names and label values; one character more would break one;
the CRD carries exactly the rules names.py makes. tests/cluster/test_operator_names.py
shows the real API server refuses and admits the same names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import yaml
from ctj_operator import builders
from ctj_operator.decisions import CreateAttempt
from ctj_operator.names import (
    FORM_MESSAGE,
    KUBEFLOW_JOB_LABEL,
    MAX_ATTEMPT,
    MAX_REPLICAS,
    Rule,
    attempt_problem,
    crd_validations,
    derived_names,
    length_message,
    max_name_length,
    name_problem,
)
from ctj_operator.render import Kind, Target, render
from ctj_operator.spec import Backend, JobSpec, NodeCache
from ctj_stack import crd_schema

from tests.unit.test_crd_schema import SCHEMA

LAST_RANK = MAX_REPLICAS - 1
NAME_RULES = {
    Kind.SERVICE: Rule.DNS1035_LABEL,
    Kind.PYTORCHJOB: Rule.DNS1035_LABEL,  # Kubeflow's webhook: NameIsDNS1035Label
    Kind.TRAINJOB: Rule.DNS1035_LABEL,  # its JobSet and headless Service are named the same
}
"""What a name must be, by kind; every other kind (pods, Secrets, policies): a subdomain."""


def longest(backend: Backend) -> str:
    """The longest name the CRD admits, all of it letters the rules allow."""
    return ("j" + "0123456789-abcdefghijklmnopqrstuvwxyz" * 2)[: max_name_length(backend) - 1] + "z"


def spec(backend: Backend, replicas: int = 3) -> JobSpec:
    return JobSpec.parse(
        {
            "replicas": replicas,
            "maxReplicas": MAX_REPLICAS,
            "backend": backend.value,
            "checkpoint": {"uri": "s3://b/jobs"},
            "template": {
                "metadata": {"labels": {"team": "ml"}},
                "spec": {"containers": [{"name": "t", "image": "t:1"}]},
            },
        },
        node_cache=NodeCache(),
    )


def body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "n" * 63, "uid": "u-1"}}


def label_values(obj: Any, path: str = "") -> Iterator[tuple[str, str]]:
    """Every label value in ``obj``: labels, selectors' matchLabels, a Service's selector."""
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            here = f"{path}.{key}"
            if key in ("labels", "matchLabels") or here.endswith("spec.selector"):
                if isinstance(value, Mapping):
                    yield from ((f"{here}[{k}]", str(v)) for k, v in value.items())
                    continue
            yield from label_values(value, here)
    elif isinstance(obj, list):
        for i, item in enumerate(obj):
            yield from label_values(item, f"{path}[{i}]")


def problems(kind: Kind, obj: Mapping[str, Any]) -> list[str]:
    """Each name or label value in ``obj`` Kubernetes would refuse."""
    found = []
    meta = obj["metadata"]
    checks = [("metadata.name", meta["name"], NAME_RULES.get(kind, Rule.DNS1123_SUBDOMAIN))]
    if kind == Kind.POD:
        checks += [
            ("spec.hostname", obj["spec"]["hostname"], Rule.DNS1123_LABEL),
            ("spec.subdomain", obj["spec"]["subdomain"], Rule.DNS1123_LABEL),
        ]
    checks += [(where, value, Rule.LABEL_VALUE) for where, value in label_values(obj)]
    for where, value, rule in checks:
        problem = rule.problem(value)
        if problem is not None:
            found.append(f"{kind.value} {meta['name']} {where}={value!r}: {problem}")
    return found


def kubeflow_pod_name(pytorchjob: str, replica_type: str, index: int) -> str:
    """How Kubeflow's controller names a replica's pod and Service (training-operator
    v1.8.1, pkg/controller.v1/common/util.go GenGeneralName)."""
    return f"{pytorchjob}-{replica_type.lower()}-{index}".replace("/", "-")


# ---- the CRD carries the rules names.py makes ----


def test_the_crd_carries_the_rules_names_py_makes() -> None:
    """hack/crd-schema.sh --local --check: crds/ and the chart's copy hold what names.py
    generates, so the limit is typed once."""
    assert crd_schema.main(["--local", "--check"]) == 0
    assert SCHEMA["x-kubernetes-validations"] == crd_validations()["x-kubernetes-validations"]
    max_replicas = SCHEMA["properties"]["spec"]["properties"]["maxReplicas"]
    assert max_replicas["maximum"] == MAX_REPLICAS
    assert str(MAX_REPLICAS) in max_replicas["description"]


def test_the_rules_are_checked_at_create_only() -> None:
    """A name never changes, and a job stored before the rules must stay writable (its
    status, its finalizers, its deletion): tests/cluster/test_operator_names.py."""
    for rule in crd_validations()["x-kubernetes-validations"]:
        assert rule["optionalOldSelf"] is True
        assert rule["rule"].startswith("oldSelf.hasValue() || ")


def test_the_limit_and_why_are_in_the_message() -> None:
    limits = [max_name_length(b) for b in (Backend.PODS, Backend.PYTORCHJOB, Backend.TRAINJOB)]
    assert limits == [46, 39, 33]
    message = length_message()
    assert "at most 46 characters (39 with spec.backend pytorchjob, 33 with trainjob)" in message
    assert "63-character" in message and "Choose a shorter name" in message
    assert "DNS-1035" in FORM_MESSAGE and "Rename the job" in FORM_MESSAGE


# ---- every object fits for the longest admitted name ----


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
def test_every_object_of_the_last_attempt_fits_for_the_longest_name(backend: Backend) -> None:
    name = longest(backend)
    assert name_problem(name, backend) is None
    target = Target(body=body(name), spec=spec(backend), uri="s3://b/jobs/x", cache_token="t")
    calls = render(CreateAttempt(MAX_ATTEMPT, 3), target)
    kinds = {c.kind for c in calls}
    assert Kind.SECRET in kinds and kinds & {Kind.PYTORCHJOB, Kind.TRAINJOB, Kind.POD}
    found = [p for c in calls for p in problems(c.kind, c.body)]
    assert not found, found


def test_the_largest_rank_pod_fits_for_the_longest_name() -> None:
    name = longest(Backend.PODS)
    job = spec(Backend.PODS, replicas=MAX_REPLICAS)
    pod = builders.build_pod(
        body(name), job, uri="s3://x", attempt=MAX_ATTEMPT, world_size=MAX_REPLICAS,
        node_rank=LAST_RANK,
    )  # fmt: skip
    assert pod["metadata"]["name"] == f"{name}-a{MAX_ATTEMPT}-{LAST_RANK}"
    assert len(pod["spec"]["hostname"]) == 63  # the limit is tight: no character wasted
    assert not problems(Kind.POD, pod)


def test_kubeflows_pods_and_services_fit_for_the_longest_name() -> None:
    """The PyTorchJob's controller names its pods and per-pod Services itself: the largest
    worker index, at the last attempt, is a DNS-1035 label, and so is what we expect it to
    be named (builders.rank_pod_name, how the operator finds it)."""
    name = longest(Backend.PYTORCHJOB)
    job = spec(Backend.PYTORCHJOB, replicas=MAX_REPLICAS)
    pytorchjob = builders.build_pytorchjob(
        body(name), job, uri="s3://x", attempt=MAX_ATTEMPT, world_size=MAX_REPLICAS
    )
    assert not problems(Kind.PYTORCHJOB, pytorchjob)
    pj = pytorchjob["metadata"]["name"]
    workers = pytorchjob["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"]
    assert workers == MAX_REPLICAS - 1
    made = [kubeflow_pod_name(pj, "Master", 0), kubeflow_pod_name(pj, "Worker", workers - 1)]
    assert made == [builders.rank_pod_name(job, name, MAX_ATTEMPT, r) for r in (0, LAST_RANK)]
    assert len(made[1]) == 63
    for pod in made:
        assert Rule.DNS1035_LABEL.problem(pod) is None, pod
    assert Rule.LABEL_VALUE.problem(pj) is None  # KUBEFLOW_JOB_LABEL on each pod
    assert KUBEFLOW_JOB_LABEL.startswith("training.kubeflow.org/")


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
def test_one_character_more_would_break_a_derived_name(backend: Backend) -> None:
    """The limit is the largest that always fits: one more, and the last attempt's largest
    rank is named past 63 characters (and the CRD refuses it)."""
    name = longest(backend) + "q"
    assert name_problem(name, backend) == length_message()
    too_long = [
        d.what
        for d in derived_names(name, backend, attempt=MAX_ATTEMPT, rank=LAST_RANK)
        if d.rule.problem(d.value) is not None
    ]
    assert too_long
    assert attempt_problem(name, backend, attempt=MAX_ATTEMPT, world_size=MAX_REPLICAS)
    assert attempt_problem(name, backend, attempt=1, world_size=1) is None  # fits, today


# ---- the rules in Python ----


@pytest.mark.parametrize(
    ("name", "admitted"),
    [
        ("a", True),
        ("train-1b", True),
        ("a--b", True),
        ("1b-train", False),  # a Service's name starts with a letter
        ("train.1b", False),  # a valid object name, but no Service can carry it
        ("Train", False),
        ("train-", False),
        ("", False),
    ],
)
def test_a_name_must_be_a_dns_1035_label(name: str, admitted: bool) -> None:
    assert (name_problem(name, Backend.PODS) is None) == admitted
    if not admitted:
        assert name_problem(name, Backend.PODS) == FORM_MESSAGE


def test_an_attempt_whose_names_would_not_fit_is_named_before_it_is_made() -> None:
    """For a job stored before the rules (or past MAX_ATTEMPT): the operator can fail it
    saying which name, rather than make pods the API server refuses, attempt after
    attempt. A 58-character name: its pods fit until attempt 10 or rank 10."""
    old = "j" * 58
    assert attempt_problem(old, Backend.PODS, attempt=9, world_size=10) is None
    late = attempt_problem(old, Backend.PODS, attempt=10, world_size=10)
    assert late is not None and "hostname" in late and "at most 46 characters" in late
    assert attempt_problem(old, Backend.PODS, attempt=9, world_size=11) is not None
    assert attempt_problem("a", Backend.PODS, attempt=MAX_ATTEMPT, world_size=MAX_REPLICAS) is None
    past = attempt_problem("a", Backend.PODS, attempt=MAX_ATTEMPT + 1, world_size=1)
    assert past is not None and str(MAX_ATTEMPT) in past


def test_the_generated_block_is_yaml_the_api_server_reads_back() -> None:
    """The rule strings survive YAML quoting (quotes, colons, '<' and '>')."""
    text = yaml.safe_dump(crd_validations(), width=10_000)
    assert yaml.safe_load(text) == crd_validations()


def test_local_only_rewrites_the_name_rules_and_keeps_kubernetes_types() -> None:
    """--local (no API server): the names block is written, an OpenAPI block kept as is."""
    crd = (
        "root:\n"
        "  # BEGIN generated: ctj_operator.names.crd_validations\n"
        "  stale: true\n"
        "  # END generated\n"
        "  spec:\n"
        "    # BEGIN generated: io.k8s.api.core.v1.PodTemplateSpec from Kubernetes 1.34\n"
        "    kept: true\n"
        "    # END generated\n"
    )
    once = crd_schema.splice(crd, None, "unused")
    parsed = yaml.safe_load(once)["root"]
    assert parsed["x-kubernetes-validations"] == crd_validations()["x-kubernetes-validations"]
    assert "stale" not in parsed and parsed["spec"] == {"kept": True}
    assert "from operator/ctj_operator/names.py (hack/crd-schema.sh)" in once
    assert crd_schema.splice(once, None, "unused") == once
