"""What `helm template` makes of charts/ctj for availability and for users: two operator
replicas that roll and drain without a gap, the roles aggregated into Kubernetes' own,
and the NOTES an install prints. Real helm, no cluster (tests/cluster/test_chart.py
installs the chart into a real API server)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from ctj_operator.leader import ElectionConfig

from tests.unit.chart_helm import CHART, ROOT, Helm, helm, render, render_notes, the

__all__ = ["helm"]  # the fixture, used by name

GROUP = "training.ctj.dev"
AGGREGATE = "rbac.authorization.k8s.io/aggregate-to-"


def pod_template(objects: dict[tuple[str, str], Any]) -> dict[str, Any]:
    return dict(the(objects, "Deployment")["spec"]["template"])


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_two_replicas_roll_one_at_a_time_behind_a_ready_standby(helm: Helm) -> None:
    deployment = the(render(helm), "Deployment")
    assert deployment["spec"]["replicas"] == 2
    # a new pod is added and ready before an old one goes; leader election keeps the
    # old and the new from acting at once
    assert deployment["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    ready = container["readinessProbe"]["httpGet"]
    assert ready == {"path": "/healthz", "port": "liveness"} and "liveness" in ports

    recreate = the(render(helm, "updateStrategy.type=Recreate"), "Deployment")
    # the API server refuses rollingUpdate beside Recreate
    assert recreate["spec"]["strategy"] == {"type": "Recreate"}


def test_replicas_prefer_different_nodes_by_hostname(helm: Helm) -> None:
    template = pod_template(render(helm))
    (term,) = template["spec"]["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["weight"] == 100
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    # the term selects this release's operator pods, and only by their stable labels
    selector = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
    assert matches(selector, template["metadata"]["labels"])
    assert selector == the(render(helm), "Deployment")["spec"]["selector"]["matchLabels"]

    required = pod_template(render(helm, "podAntiAffinity=required"))["spec"]["affinity"]
    (hard,) = required["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert hard == term["podAffinityTerm"]
    assert "affinity" not in pod_template(render(helm, "podAntiAffinity=none"))["spec"]


def test_anti_affinity_is_added_to_the_users_affinity_unless_it_has_its_own(
    helm: Helm,
) -> None:
    node = "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
    nodes = f"{node}.nodeSelectorTerms[0].matchExpressions[0]"
    affinity = pod_template(render(helm, f"{nodes}.key=pool,{nodes}.operator=Exists"))["spec"][
        "affinity"
    ]
    assert set(affinity) == {"nodeAffinity", "podAntiAffinity"}
    own = "affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution[0]"
    affinity = pod_template(render(helm, f"{own}.topologyKey=topology.kubernetes.io/zone"))["spec"][
        "affinity"
    ]
    assert affinity == {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"topologyKey": "topology.kubernetes.io/zone"}
            ]
        }
    }


def test_a_drain_leaves_an_operator_pod(helm: Helm) -> None:
    objects = render(helm)
    pdb = the(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["maxUnavailable"] == 1 < the(objects, "Deployment")["spec"]["replicas"]
    assert matches(
        pdb["spec"]["selector"]["matchLabels"], pod_template(objects)["metadata"]["labels"]
    )
    # one replica: a budget would block every drain of its node, or protect nothing
    for sets in ("replicaCount=1", "replicaCount=0", "podDisruptionBudget.enabled=false"):
        assert not any(k == "PodDisruptionBudget" for k, _ in render(helm, sets)), sets
    three = the(
        render(helm, "replicaCount=3,podDisruptionBudget.maxUnavailable=2"), "PodDisruptionBudget"
    )
    assert three["spec"]["maxUnavailable"] == 2


def _rules(role: dict[str, Any]) -> set[tuple[str, str, str]]:
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def test_roles_aggregated_into_edit_admin_and_view(helm: Helm) -> None:
    objects = render(helm)
    edit = objects["ClusterRole", "ctj-operator-edit"]
    view = objects["ClusterRole", "ctj-operator-view"]
    on = {k.removeprefix(AGGREGATE) for k, v in edit["metadata"]["labels"].items()
          if k.startswith(AGGREGATE) and v == "true"}  # fmt: skip
    assert on == {"edit", "admin"}
    on = {k.removeprefix(AGGREGATE) for k, v in view["metadata"]["labels"].items()
          if k.startswith(AGGREGATE) and v == "true"}  # fmt: skip
    assert on == {"view", "edit", "admin"}  # as Kubernetes' own view rules: edit reads too

    jobs, scale, status = (
        "checkpointedtrainingjobs",
        "checkpointedtrainingjobs/scale",
        ("checkpointedtrainingjobs/status"),
    )
    assert _rules(edit) == {
        *((GROUP, jobs, v) for v in ("create", "update", "patch", "delete", "deletecollection")),
        *((GROUP, scale, v) for v in ("get", "update", "patch")),
    }
    assert _rules(view) == {(GROUP, r, v) for r in (jobs, status) for v in ("get", "list", "watch")}
    # the status is the operator's alone
    assert not any(r == status and v not in ("get", "list", "watch") for _, r, v in _rules(edit))

    # users' roles are not the operator's: they stay with rbac.create=false, and go alone
    assert ("ClusterRole", "ctj-operator-edit") in render(helm, "rbac.create=false")
    off = render(helm, "rbac.aggregateToDefaultRoles=false")
    assert [n for k, n in off if k == "ClusterRole"] == [
        "ctj-operator-node-agent", "ctj-operator", "ctj-operator-nodes"
    ]  # fmt: skip


def test_values_schema_refuses_typos_in_the_new_values(helm: Helm) -> None:
    for bad in (
        "podAntiAffinity=sometimes",
        "updateStrategy.type=BlueGreen",
        "podDisruptionBudget.maxUnavailable=half",
        "rbac.aggregateToDefaultRoles=maybe",
        "readinessProbe.periodSeconds=0",
    ):
        proc = helm("template", "x", str(CHART), "--set", bad, check=False)
        assert proc.returncode != 0, f"--set {bad} rendered"
        assert "values don't meet the specifications of the schema" in proc.stderr, bad


def test_notes_name_what_the_chart_made(helm: Helm, tmp_path: Path) -> None:
    objects = render(helm)
    notes = render_notes(helm, tmp_path)
    service = the(objects, "Service")
    forward = re.search(r"kubectl -n (\S+) port-forward svc/(\S+) (\d+)", notes)
    assert forward, notes
    assert forward.groups() == (
        service["metadata"]["namespace"],
        service["metadata"]["name"],
        str(service["spec"]["ports"][0]["port"]),
    )
    rollout = re.search(r"rollout status deployment/(\S+)", notes)
    assert rollout and ("Deployment", rollout.group(1)) in objects
    # the Lease the operator elects its leader on (the chart passes no other name)
    (container,) = pod_template(objects)["spec"]["containers"]
    assert not any(a.startswith("--leader-election-name") for a in container["args"])
    assert f"get lease {ElectionConfig(namespace='x').name} " in notes
    crds = re.search(r"kubectl apply --server-side -f (\S+)", notes)
    assert crds and (ROOT / crds.group(1)).is_dir()
    assert "docs/troubleshooting.md" in notes and (ROOT / "docs" / "troubleshooting.md").is_file()
    assert "WARNING" not in notes


@pytest.mark.parametrize(
    ("sets", "warning"),
    [
        ("replicaCount=0", "no operator runs"),
        ("rbac.create=false", "ServiceAccount ctj-system/ctj-operator yourself"),
    ],
)
def test_notes_warn_of_an_operator_that_cannot_act(
    helm: Helm, tmp_path: Path, sets: str, warning: str
) -> None:
    notes = render_notes(helm, tmp_path, sets)
    assert "WARNING" in notes and warning in " ".join(notes.split()), notes
