"""The operator's RBAC as `helm template` renders it, in both install modes: what it may do
and where (docs/security.md, "RBAC"). Real helm, no cluster; the cluster tier asks a real
API server (tests/cluster/test_operator_least_privilege.py)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.unit.chart_helm import CHART, ROOT, Helm, helm

__all__ = ["helm"]  # the fixture, used by name

RBAC_KINDS = ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
RELEASE_NS = "ctj-system"
SA = {"kind": "ServiceAccount", "name": "ctj-operator", "namespace": RELEASE_NS}
Key = tuple[str, str | None, str]  # kind, namespace, name


AGENT_SA = {"kind": "ServiceAccount", "name": "ctj-operator-node-agent", "namespace": RELEASE_NS}


def rbac(helm: Helm, *sets: str, agent: bool = False) -> dict[Key, Any]:
    """The operator's roles and bindings (not the users' aggregated ones), or with
    ``agent`` the node agents' (named ``<release>-node-agent``)."""
    args = ["template", "ctj-operator", str(CHART), "-n", RELEASE_NS, "--set",
            "rbac.aggregateToDefaultRoles=false"]  # fmt: skip
    for s in sets:
        args += ["--set", s]
    return {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in yaml.safe_load_all(helm(*args).stdout)
        if d and d["kind"] in RBAC_KINDS and d["metadata"]["name"].endswith("-node-agent") == agent
    }


def grants(
    objects: dict[Key, Any], sa: dict[str, str] = SA
) -> set[tuple[str | None, str, str, str, str]]:
    """(namespace or None for cluster-wide, apiGroup, resource, verb, resourceName or "")
    for every rule bound to the operator's ServiceAccount."""
    out = set()
    for (kind, ns, _), binding in objects.items():
        if not kind.endswith("Binding"):
            continue
        assert binding["subjects"] == [sa]
        ref = binding["roleRef"]
        role = objects[(ref["kind"], ns if ref["kind"] == "Role" else None, ref["name"])]
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    for verb in rule["verbs"]:
                        for name in rule.get("resourceNames") or [""]:
                            out.add((ns, group, resource, verb, name))
    return out


def test_the_defaults_are_deploy_operator_rbac_verbatim(helm: Helm) -> None:
    reference = {
        (d["kind"], d["metadata"].get("namespace"), d["metadata"]["name"]): d
        for d in yaml.safe_load_all((ROOT / "deploy" / "operator-rbac.yaml").read_text())
        if d and d["kind"] in RBAC_KINDS
    }
    rendered = rbac(helm)
    assert set(rendered) == set(reference)
    for key, ours in rendered.items():
        for field in ("rules", "roleRef", "subjects"):
            assert ours.get(field) == reference[key].get(field), (key, field)


@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={team-a,team-b}",)])
def test_nothing_that_reaches_past_the_operator_s_own_objects(
    helm: Helm, sets: tuple[str, ...]
) -> None:
    rules = grants(rbac(helm, *sets))
    assert rules
    # no Role or binding made or changed (it could grant itself anything)
    assert not {r for r in rules if r[1] == "rbac.authorization.k8s.io"}
    # Secrets are created (a job's token), never read
    assert {r[3] for r in rules if r[2] == "secrets"} == {"create"}
    # Leases: its own leader Lease, by name, in its own namespace; kubelets' read-only
    leases = {(ns, verb, name) for ns, _, res, verb, name in rules if res == "leases"}
    assert leases == {
        (RELEASE_NS, "create", ""),
        (RELEASE_NS, "get", "ctj-operator"),
        (RELEASE_NS, "update", "ctj-operator"),
        ("kube-node-lease", "list", ""),
        ("kube-node-lease", "watch", ""),
    }
    # no update/patch of nodes or anything but its jobs and their pods (a survivor's labels,
    # relabelled for the next attempt: nothing that creating pods does not already allow)
    patched = {(g, res) for _, g, res, verb, _ in rules if verb in ("patch", "update")}
    assert patched <= {
        ("", "pods"),
        ("training.ctj.dev", "checkpointedtrainingjobs"),
        ("training.ctj.dev", "checkpointedtrainingjobs/status"),
        ("coordination.k8s.io", "leases"),  # the leader Lease, above
        ("kueue.x-k8s.io", "workloads/status"),  # what Kueue's own integrations write
    }
    # Kueue: its jobs' Workloads; the queues and flavors only read
    kueue = {(res, verb) for _, g, res, verb, _ in rules if g == "kueue.x-k8s.io"}
    assert {res for res, _ in kueue} == {
        "workloads",
        "workloads/status",
        "resourceflavors",
        "workloadpriorityclasses",
    }
    assert {verb for res, verb in kueue if res != "workloads"} <= {"list", "watch", "patch"}
    assert {r[3] for r in rules if r[2] == "nodes"} == {"list", "watch"}
    assert not {r for r in rules if "*" in r}


def test_namespaced_mode_writes_only_in_the_watched_namespaces(helm: Helm) -> None:
    objects = rbac(helm, "operator.watchNamespaces={team-a,team-b}")
    rules = grants(objects)
    cluster_wide = {r[1:4] for r in rules if r[0] is None}
    assert cluster_wide == {
        (group, res, verb)
        for group, res in (("", "nodes"), ("kueue.x-k8s.io", "resourceflavors"),
                           ("kueue.x-k8s.io", "workloadpriorityclasses"))
        for verb in ("list", "watch")
    }  # fmt: skip
    writes = {"create", "delete", "patch", "update"}
    where = {ns for ns, _, res, verb, _ in rules if verb in writes and res != "leases"}
    assert where == {"team-a", "team-b"}
    # the same rules in each watched namespace as the ClusterRole gives everywhere
    nodes = {r[1:] for r in rules if r[0] is None}
    everywhere = {r[1:] for r in grants(rbac(helm)) if r[0] is None} - nodes
    for ns in ("team-a", "team-b"):
        assert {r[1:] for r in rules if r[0] == ns} == everywhere
    assert ("ClusterRoleBinding", None, "ctj-operator") not in objects
    # and the operator is told to watch only those
    args = ["template", "ctj-operator", str(CHART), "-n", RELEASE_NS,
            "--set", "operator.watchNamespaces={team-a,team-b}"]  # fmt: skip
    deployment = next(
        d for d in yaml.safe_load_all(helm(*args).stdout) if d and d["kind"] == "Deployment"
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert [a for a in container["args"] if a.startswith("--namespace")] == [
        "--namespace=team-a",
        "--namespace=team-b",
    ]


def test_no_rbac_objects_when_rbac_create_is_false(helm: Helm) -> None:
    for agent in (False, True):
        assert rbac(helm, "rbac.create=false", agent=agent) == {}
        assert (
            rbac(helm, "rbac.create=false", "operator.watchNamespaces={team-a}", agent=agent) == {}
        )


@pytest.mark.parametrize("sets", [(), ("operator.watchNamespaces={team-a,team-b}",)])
def test_the_node_agents_may_only_list_and_watch_jobs(helm: Helm, sets: tuple[str, ...]) -> None:
    """What removes a deleted job's data from the nodes: its uid no longer listed."""
    rules = grants(rbac(helm, *sets, agent=True), AGENT_SA)
    where = {None} if not sets else {"team-a", "team-b"}
    assert rules == {
        (ns, "training.ctj.dev", "checkpointedtrainingjobs", verb, "")
        for ns in where
        for verb in ("list", "watch")
    }
