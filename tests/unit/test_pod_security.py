"""Every container ctj adds meets the `restricted` Pod Security Standard: the sidecar in
the pods it builds (both backends), the operator in the chart. A user's template that
meets it gives a pod that meets it; one that does not is judged on its own containers
only. The rule check (tests/unit/pod_security.py) is itself tested on a known-bad pod."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from ctj_operator import builders
from ctj_operator.spec import JobSpec, NodeCache

from tests.unit.chart_helm import CHART, ROOT, Helm, helm
from tests.unit.pod_security import violations, writable_root
from tests.unit.test_operator_builders import job_spec, pod_specs

__all__ = ["helm"]  # the fixture, used by name

RESTRICTED_TRAINER = {
    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [
        {
            "name": "trainer",
            "image": "trainer:1",
            "command": ["python", "train.py"],
            "securityContext": {
                "allowPrivilegeEscalation": False,
                "capabilities": {"drop": ["ALL"]},
            },
        }
    ],
}
OURS = {builders.SIDECAR_NAME}


def restricted_spec(backend: str = "pods") -> JobSpec:
    return job_spec(backend=backend, template={"spec": copy.deepcopy(RESTRICTED_TRAINER)})


# ---- the check itself ----


def test_the_check_names_each_rule_a_known_bad_pod_breaks() -> None:
    bad = {
        "hostNetwork": True,
        "securityContext": {"runAsUser": 0, "sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
        "volumes": [{"name": "cache", "hostPath": {"path": "/var/lib/x"}}],
        "initContainers": [
            {
                "name": "chmod",
                "image": "x",
                "securityContext": {"runAsNonRoot": False, "capabilities": {"add": ["CHOWN"]}},
            }
        ],
        "containers": [
            {
                "name": "main",
                "image": "x",
                "ports": [{"name": "p", "containerPort": 80, "hostPort": 80}],
                "securityContext": {
                    "privileged": True,
                    "allowPrivilegeEscalation": True,
                    "seccompProfile": {"type": "Unconfined"},
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    }
    found = "\n".join(violations(bad))
    for expected in (
        "pod: spec.hostNetwork is true",
        "pod: volume cache is hostPath",
        "pod: securityContext.runAsUser is 0",
        "pod: securityContext.sysctls has kernel.msgmax",
        "container chmod: securityContext.runAsNonRoot must be true",
        "container chmod: securityContext.allowPrivilegeEscalation must be false",
        "container chmod: securityContext.capabilities.drop must include ALL",
        "container chmod: securityContext.capabilities.add has ['CHOWN']",
        "container chmod: securityContext.seccompProfile.type must be",
        "container main: securityContext.privileged is true",
        "container main: securityContext.allowPrivilegeEscalation must be false",
        "container main: securityContext.seccompProfile.type must be RuntimeDefault or "
        "Localhost (here or in the pod's), is Unconfined",
        "container main: port p has a hostPort",
        "container main: securityContext.runAsUser is 0",  # the pod's, inherited
    ):
        assert expected in found, f"{expected!r} not in:\n{found}"
    assert violations(RESTRICTED_TRAINER) == []
    assert writable_root(RESTRICTED_TRAINER) == ["trainer"]


def test_pod_level_settings_count_for_each_container_and_one_may_not_undo_them() -> None:
    spec = copy.deepcopy(RESTRICTED_TRAINER)
    assert violations(spec) == []
    spec["containers"][0]["securityContext"]["runAsNonRoot"] = False
    assert violations(spec) == [
        "container trainer: securityContext.runAsNonRoot must be true (here or in the pod's)"
    ]


# ---- what ctj adds to a job's pods ----


@pytest.mark.parametrize("backend", ["pods", "pytorchjob"])
def test_a_restricted_template_gives_restricted_pods(backend: str) -> None:
    for pod_spec in pod_specs(restricted_spec(backend)):
        assert violations(pod_spec) == []
        assert writable_root(pod_spec, OURS) == []  # the sidecar's root is read-only


@pytest.mark.parametrize("backend", ["pods", "pytorchjob"])
def test_the_sidecar_is_restricted_whatever_the_template(backend: str) -> None:
    """The default template sets no securityContext: only its own trainer fails, and the
    pod-level fields ctj adds (the staging and /tmp volumes) pass."""
    for pod_spec in pod_specs(job_spec(backend=backend)):
        assert violations(pod_spec, OURS) == []
        trainer = pod_spec["containers"][0]["name"]  # "pytorch" under a PyTorchJob
        assert violations(pod_spec)
        assert all(v.startswith(f"container {trainer}:") for v in violations(pod_spec))


def test_the_sidecar_s_only_writable_places_are_its_volumes() -> None:
    (pod_spec, *_) = pod_specs(restricted_spec())
    sidecar = pod_spec["initContainers"][-1]
    assert sidecar["name"] == builders.SIDECAR_NAME
    mounts = {m["mountPath"]: m["name"] for m in sidecar["volumeMounts"]}
    assert mounts["/tmp"] == builders.SIDECAR_TMP_VOLUME
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    assert set(mounts.values()) <= set(volumes)
    assert all("emptyDir" in volumes[name] for name in mounts.values())
    # no uid of ours: the image's numeric USER reads what the trainer staged, as before
    assert "runAsUser" not in sidecar["securityContext"]


def test_the_template_s_own_settings_stay_the_user_s() -> None:
    """The operator adds no privilege: a template's securityContext reaches the pod as
    written, and a privileged template stays privileged (admission judges it, not us)."""
    template = copy.deepcopy(RESTRICTED_TRAINER)
    template["containers"][0]["securityContext"] = {"privileged": True}
    (pod_spec, *_) = pod_specs(job_spec(template={"spec": template}))
    assert pod_spec["securityContext"] == RESTRICTED_TRAINER["securityContext"]
    assert pod_spec["containers"][0]["securityContext"] == {"privileged": True}
    assert violations(pod_spec, OURS) == []


# ---- the images and the chart ----


def test_every_image_runs_as_a_numeric_non_root_user() -> None:
    """runAsNonRoot can only verify a numeric USER (a name would make the kubelet refuse
    to start the container)."""
    stages: dict[str, list[str]] = {}
    current = ""
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["FROM"]:
            current = words[-1] if "AS" in words else ""
            stages[current] = []
        elif words[:1] == ["USER"]:
            stages[current].append(words[1])
    for target in ("operator", "sidecar", "trainer"):
        (user,) = stages[target]
        uid, _, gid = user.partition(":")
        assert uid.isdigit() and int(uid) > 0 and (not gid or gid.isdigit()), (target, user)


def chart_pods(helm: Helm, *sets: str) -> list[tuple[str, dict[str, Any]]]:
    args = ["template", "ctj-operator", str(CHART), "-n", "ctj-system"]
    for s in sets:
        args += ["--set", s]
    pods = []
    for doc in yaml.safe_load_all(helm(*args).stdout):
        if doc and doc["kind"] in ("Deployment", "DaemonSet", "StatefulSet", "Job"):
            pods.append((f"{doc['kind']}/{doc['metadata']['name']}", doc["spec"]["template"]))
    return pods


NODE_AGENT_EXEMPT = {
    "pod: volume cache is hostPath",
    "container node-agent: port node-cache has a hostPort",
    "container cache-owner: securityContext.runAsNonRoot must be true (here or in the pod's)",
    "container cache-owner: securityContext.runAsUser is 0",
    "container cache-owner: securityContext.capabilities.add has ['CHOWN']",
}
MOUNTER_EXEMPT = {
    # the CSI endpoint (nodeCache.mount): mounts into the kubelet's pod directories
    "pod: volume kubelet-pods is hostPath",
    "pod: volume plugin-dir is hostPath",
    "pod: volume registration-dir is hostPath",
    "container mounter: securityContext.privileged is true",
    "container mounter: securityContext.allowPrivilegeEscalation must be false",
    "container mounter: securityContext.runAsNonRoot must be true (here or in the pod's)",
    "container mounter: securityContext.runAsUser is 0",
    "container mounter: securityContext.capabilities.drop must include ALL",
}


@pytest.mark.parametrize(
    "sets",
    [
        (),
        ("nodeCache.mount.enabled=false",),
        ("operator.watchNamespaces={team-a}", "replicaCount=1", "nodeCache.enabled=false"),
    ],
)
def test_every_pod_the_chart_renders_is_restricted_with_a_read_only_root(
    helm: Helm, sets: tuple[str, ...]
) -> None:
    """The node agent (component node-agent) is the one pod allowed past `restricted`, and
    only by what holding a node's disk takes (docs/security.md): the hostPath, the hostPort
    the job's pods reach it at (status.hostIP), and one init step that owns the directory
    (root with CAP_CHOWN alone: a kubelet makes a hostPath directory root's, and fsGroup
    does not apply to hostPath). With nodeCache.mount on (the default), its mounter
    container too: privileged, as every CSI node plugin, with the kubelet's directories;
    off, none of that is rendered. Every other rule holds for it too."""
    pods = chart_pods(helm, *sets)
    assert any(name.startswith("Deployment/") for name, _ in pods)
    exempt = NODE_AGENT_EXEMPT
    if "nodeCache.mount.enabled=false" not in sets:
        exempt = exempt | MOUNTER_EXEMPT
    for name, template in pods:
        found = violations(template["spec"])
        labels = template.get("metadata", {}).get("labels") or {}
        if labels.get("app.kubernetes.io/component") == "node-agent":
            found = [v for v in found if v not in exempt]
        assert found == [], name
        assert writable_root(template["spec"]) == [], name


@pytest.mark.parametrize("manifest", ["job.yaml", "job-torchrun.yaml"])
@pytest.mark.parametrize("backend", ["pods", "pytorchjob"])
def test_the_example_job_runs_in_a_restricted_namespace(backend: str, manifest: str) -> None:
    """examples/job.yaml and job-torchrun.yaml (the e2e tier's jobs, in a namespace that
    enforces `restricted`)."""
    example = yaml.safe_load((ROOT / "examples" / manifest).read_text())
    spec = JobSpec.parse({**example["spec"], "backend": backend})
    for pod_spec in pod_specs(spec):
        assert violations(pod_spec) == []


@pytest.mark.parametrize("backend", ["pods", "pytorchjob"])
def test_the_node_caches_csi_volume_keeps_a_restricted_pod_restricted(backend: str) -> None:
    """The trainer's read-only mount of its job's node cache is an inline csi volume, a
    type `restricted` allows (a hostPath is not)."""
    raw = {"replicas": 3, "backend": backend, "checkpoint": {"uri": "s3://bucket/jobs"},
           "template": {"spec": copy.deepcopy(RESTRICTED_TRAINER)}}  # fmt: skip
    spec = JobSpec.parse(raw, node_cache=NodeCache(driver="node-cache.ctj.dev"))
    for pod_spec in pod_specs(spec):
        assert any("csi" in v for v in pod_spec["volumes"])
        assert violations(pod_spec) == []
