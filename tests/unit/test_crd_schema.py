"""The CRD as `kubectl explain` and the API server read it, checked as a file, and the
generator of its Kubernetes types (hack/ctj_stack/crd_schema.py) on small documents.
tests/cluster/test_operator_api.py applies it to a real API server: its rules, and that
the committed schema is what that server's own OpenAPI generates."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from ctj_contract import Condition, Phase
from ctj_operator.conditions import enter_phase, written
from ctj_operator.decisions import JobState, Transition, invalid_spec
from ctj_stack.crd_schema import (
    QUANTITY_PATTERN,
    properties_of,
    short_description,
    splice,
    structural,
)

from tests.unit.test_decisions import RUNNING3, decide, nodes, observe, pod, pods, spec

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "training.ctj.dev_checkpointedtrainingjobs.yaml"
CRD = yaml.safe_load(CRD_PATH.read_text())
VERSION = CRD["spec"]["versions"][0]
SCHEMA = VERSION["schema"]["openAPIV3Schema"]


def fields(node: Mapping[str, Any], path: str = "") -> Iterator[tuple[str, Mapping[str, Any]]]:
    """Every field `kubectl explain` lists: properties, through lists and maps."""
    for name, child in (node.get("properties") or {}).items():
        yield f"{path}.{name}", child
        yield from fields(child, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), Mapping):
            yield from fields(node[key], f"{path}[]")


def test_no_field_lacks_a_description() -> None:
    """`kubectl explain ctj.spec...` shows each field's description: none may read
    "<no description>". The root metadata may not have one (the API server refuses it
    and shows ObjectMeta's own)."""
    missing = [
        path
        for path, node in fields(SCHEMA)
        if path != ".metadata" and not str(node.get("description") or "").strip()
    ]
    assert not missing, f"{len(missing)} fields without a description: {missing[:20]}"
    assert len(list(fields(SCHEMA))) > 500  # the pod template is in it, not a free object
    columns = [c["name"] for c in VERSION["additionalPrinterColumns"] if not c.get("description")]
    assert not columns, f"printer columns without a description: {columns}"


def test_no_description_is_cut_short() -> None:
    """A description in a YAML flow mapping ends at its first comma; each must end as a
    sentence does (or, for Kubernetes' own, as its first sentence did)."""
    cut = [
        (path, node["description"])
        for path, node in fields(SCHEMA)
        if node.get("description")
        and node["description"].count("(") != node["description"].count(")")
    ]
    assert not cut, cut[:10]
    spec_fields = [(p, n) for p, n in fields(SCHEMA["properties"]["spec"]) if ".template" not in p]
    spec_fields += list(fields(SCHEMA["properties"]["status"]))
    unfinished = [p for p, n in spec_fields if not n["description"].rstrip().endswith((".", ")"))]
    assert not unfinished, unfinished


def test_nothing_is_left_free_form_but_status_as_a_safety_net() -> None:
    free = [p for p, n in fields(SCHEMA) if n.get("x-kubernetes-preserve-unknown-fields")]
    assert free == [".status"]


def test_the_pod_template_is_kubernetes_own_schema() -> None:
    template = SCHEMA["properties"]["spec"]["properties"]["template"]
    pod = template["properties"]["spec"]
    container = pod["properties"]["containers"]["items"]
    assert container["required"] == ["name"]
    assert pod["properties"]["containers"]["x-kubernetes-list-map-keys"] == ["name"]
    limits = container["properties"]["resources"]["properties"]["limits"]["additionalProperties"]
    assert limits["x-kubernetes-int-or-string"] and limits["pattern"] == QUANTITY_PATTERN
    port = container["properties"]["ports"]["items"]["properties"]
    assert port["protocol"]["default"] == "TCP"  # a list-map key: kept, as the server requires
    assert "ephemeralContainers" not in pod["properties"]  # a pod is never created with them
    assert set(template["properties"]["metadata"]["properties"]) == {
        "annotations",
        "finalizers",
        "labels",
        "name",
        "namespace",
    }
    assert "$ref" not in json.dumps(SCHEMA) and "allOf" not in json.dumps(SCHEMA)


def test_the_crd_fits_client_side_kubectl_apply() -> None:
    """`kubectl apply` (client side) keeps the whole object in an annotation, and a
    object's annotations may hold at most 256 KiB."""
    assert len(json.dumps(CRD, separators=(",", ":"))) < 200 * 1024


def test_the_condition_types_are_the_contracts() -> None:
    item = SCHEMA["properties"]["status"]["properties"]["conditions"]["items"]
    described = item["properties"]["type"]["description"]
    assert all(kind.value in described for kind in Condition)
    assert SCHEMA["properties"]["status"]["properties"]["phase"]["enum"] == [p.value for p in Phase]


def test_what_cannot_change_mid_run_is_immutable_and_the_rest_says_when_it_applies() -> None:
    spec_schema = SCHEMA["properties"]["spec"]["properties"]
    transition_rules = {
        path: [r for r in n.get("x-kubernetes-validations") or () if "oldSelf" in r["rule"]]
        for path, n in fields(SCHEMA["properties"]["spec"])
        if ".template." not in path
    }
    immutable = sorted(path for path, rules in transition_rules.items() if rules)
    assert immutable == [".backend", ".checkpoint"]  # checkpoint: its uri and endpoint
    for field in ("template", "nprocPerNode"):
        assert "applies from the next attempt" in spec_schema[field]["description"]
    checkpoint = spec_schema["checkpoint"]["properties"]
    for field in ("intervalSteps", "credentialsSecret"):
        assert "applies from the next attempt" in checkpoint[field]["description"]


def test_every_status_field_the_operator_writes_is_declared() -> None:
    """Status keeps unknown fields (an operator newer than its CRD), so a field written
    but not declared would pass silently: each one the decisions write is declared."""
    declared = SCHEMA["properties"]["status"]["properties"]
    waiting = dataclasses.replace(RUNNING3, transition=Transition("Resize", "m", 5.0, "1-R-5"))
    conditions = tuple(enter_phase([], Phase.RUNNING, "Started", "m", now=0.0, generation=1))
    plans = [
        decide(observe(JobState(), [], nodes(3))),
        decide(observe(JobState(), [], nodes(0))),
        decide(observe(RUNNING3, pods(2) + [pod(2, node="bad0")], nodes(2, not_ready=1))),
        decide(observe(RUNNING3, pods(3), nodes(3), 5.0, job=spec(replicas=2))),
        decide(observe(waiting, pods(3, "Succeeded"), nodes(3), 6.0, job=spec(replicas=2))),
        decide(observe(RUNNING3, pods(3), nodes(3), last_checkpoint={"step": 1, "time": "t"})),
        decide(observe(dataclasses.replace(RUNNING3, world_size=2), pods(2), nodes(3), 1.0)),
        decide(observe(RUNNING3, pods(3, "Succeeded"), nodes(3))),
        decide(observe(RUNNING3, pods(3), nodes(3), 10.0**6, job=spec(activeDeadlineSeconds=1))),
        decide(
            dataclasses.replace(
                observe(dataclasses.replace(RUNNING3, conditions=conditions), pods(3), nodes(3)),
                generation=2,
                selector="s",
            )
        ),
        decide(
            observe(dataclasses.replace(RUNNING3, pods_created=False), [], nodes(3), refused="no")
        ),
        written(invalid_spec(JobState(), "bad", 1), (), now=0.0, generation=1),
    ]
    fields = set().union(*(p.status().keys() for p in plans))
    assert fields - set(declared) == set()
    assert {"observedGeneration", "selector", "startTime", "conditions", "transition"} <= fields


# ---- the generator, on small documents ----

DOC: dict[str, Any] = {
    "a.Pod": {
        "description": "Pod is a pod. More info: somewhere.",
        "type": "object",
        "properties": {
            "meta": {"description": "Standard metadata.", "allOf": [{"$ref": "#/c/s/a.Meta"}]},
            "ports": {
                "description": "Ports, e.g. 80. Each is unique.",
                "type": "array",
                "items": {"default": {}, "allOf": [{"$ref": "#/c/s/a.Port"}]},
                "x-kubernetes-list-type": "map",
                "x-kubernetes-list-map-keys": ["port", "protocol"],
                "x-kubernetes-patch-strategy": "merge",
            },
            "limits": {
                "type": "object",
                "description": "Limits.",
                "additionalProperties": {"$ref": "#/c/s/q.Quantity"},
            },
            "started": {"$ref": "#/c/s/m.Time", "description": "When."},
            "target": {"allOf": [{"$ref": "#/c/s/i.IntOrString"}]},
            "policy": {
                "type": "string",
                "default": "Always",
                "enum": ["Always", "Never"],
                "description": "Policy.\n\nPossible enum values:\n - `Always` always",
            },
            "ephemeralContainers": {"type": "array", "items": {"type": "string"}},
        },
    },
    "a.Port": {
        "type": "object",
        "required": ["port"],
        "properties": {
            "port": {"type": "integer", "format": "int32", "default": 0, "description": "P."},
            "protocol": {"type": "string", "default": "TCP", "description": "TCP or UDP."},
        },
    },
    "a.Meta": {
        "type": "object",
        "properties": {
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "uid": {"type": "string"},
        },
    },
    "q.Quantity": {"description": "Quantity.", "oneOf": [{"type": "string"}, {"type": "number"}]},
    "m.Time": {"type": "string", "format": "date-time"},
    "i.IntOrString": {"format": "int-or-string", "description": "Either."},
    "a.Loop": {"type": "object", "properties": {"me": {"$ref": "#/c/s/a.Loop"}}},
}


@pytest.fixture
def doc(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    from ctj_stack import crd_schema

    monkeypatch.setattr(crd_schema, "OBJECT_META", "a.Meta")
    monkeypatch.setattr(crd_schema, "QUANTITY", "q.Quantity")
    monkeypatch.setattr(crd_schema, "INT_OR_STRING", "i.IntOrString")
    monkeypatch.setattr(crd_schema, "TIME", ("m.Time",))
    monkeypatch.setattr(crd_schema, "OMITTED", {"a.Pod": ("ephemeralContainers",)})
    return DOC


@pytest.mark.parametrize(
    ("text", "first"),
    [
        ("Pod is a pod. More info: https://x", "Pod is a pod."),
        ("Use e.g. TCP. Or not.", "Use e.g. TCP."),
        ("One line\n\nMore paragraphs.", "One line"),
        ("Policy.\n\nPossible enum values:\n - `A` a", "Policy."),
        ("Ends with a version 1.2 number. Then", "Ends with a version 1.2 number."),
    ],
)
def test_a_description_is_its_first_sentence(text: str, first: str) -> None:
    assert short_description(text) == first


def test_a_definition_becomes_a_structural_schema(doc: dict[str, Any]) -> None:
    got = properties_of(doc, "a.Pod")
    assert got["meta"] == {
        "description": "Standard metadata.",
        "type": "object",
        "properties": {"labels": {"type": "object", "additionalProperties": {"type": "string"}}},
    }
    ports = got["ports"]
    assert ports["x-kubernetes-list-map-keys"] == ["port", "protocol"]
    assert "x-kubernetes-patch-strategy" not in ports
    assert ports["items"]["properties"]["protocol"]["default"] == "TCP"  # a map key, optional
    assert "default" not in ports["items"]["properties"]["port"]  # required: no default needed
    assert "default" not in ports["items"]
    assert got["limits"]["additionalProperties"] == {
        "description": "Quantity.",
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "pattern": QUANTITY_PATTERN,
        "x-kubernetes-int-or-string": True,
    }
    assert got["started"] == {"description": "When.", "type": "string", "format": "date-time"}
    assert got["target"]["x-kubernetes-int-or-string"] and "pattern" not in got["target"]
    assert got["policy"] == {
        "description": "Policy.",
        "type": "string",
        "enum": ["Always", "Never"],
    }
    assert "ephemeralContainers" not in got


def test_a_recursive_type_is_refused(doc: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="a.Loop -> a.Loop"):
        structural(doc, {"$ref": "#/c/s/a.Loop"})


def test_only_the_marked_blocks_are_rewritten(doc: dict[str, Any]) -> None:
    crd = (
        "a: 1  # kept\n"
        "x:\n"
        "  y:\n"
        "    type: object\n"
        "    # BEGIN generated: a.Port from somewhere (hack/crd-schema.sh)\n"
        "    stale: true\n"
        "    # END generated\n"
        "z: 2\n"
    )
    once = splice(crd, doc, "Kubernetes 1.34")
    assert once.startswith("a: 1  # kept\n") and once.endswith("    # END generated\nz: 2\n")
    assert "stale" not in once
    assert "# BEGIN generated: a.Port from Kubernetes 1.34 (hack/crd-schema.sh)" in once
    parsed = yaml.safe_load(once)
    assert parsed["x"]["y"]["properties"]["port"]["type"] == "integer"
    assert splice(once, doc, "Kubernetes 1.34") == once
    with pytest.raises(ValueError, match="no '# END generated'"):
        splice(crd.replace("    # END generated\n", ""), doc, "k")
