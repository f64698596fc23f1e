"""Kueue on kind, installed as its own release manifests install it (webhooks, certificate
rotation, the pod integration on; its manager our image of v0.19.0, built here), the
operator restarted to drive it: issue 25's scenario, on real kubelets.

A ClusterQueue of 3 pods. Job ``low`` (priority 100) asks for 4 ranks, at least 2: Kueue
admits 3 (partial admission) and it runs at 3, saying PodsReady. Job ``mid`` (priority
100, 1 rank) finds no quota left and waits Queued. Job ``high`` (priority 1000, 1 rank)
preempts ``low``: it is asked to checkpoint, stops at a step it saved (every rank exits
0: "checkpointed and stopped"), gives its quota back, and runs again at the 2 ranks Kueue
admits next, from no earlier than its last commit, resharded; ``mid`` still waits. When
``high`` ends its quota goes to ``mid``. ``kubectl patch`` of ``low``'s spec.suspend
pauses it with a checkpoint and gives its quota back; unsuspended, it is admitted again
and resumes from that checkpoint. (The cluster tier reads the stopped ranks' logs, gone
here with their pods, and checks it restored exactly the step they stopped at.) Kueue is
removed after, and the operator restarted again.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ctj_stack import Stack
from ctj_stack.scenario import NO_STANDBY, TRAINING, condition

KUEUE = "kueue.x-k8s.io/v1beta2"
KUEUE_API = ("kueue.x-k8s.io", "v1beta2")
QUEUE = "team"


def _kueue_object(kind: str, name: str, **fields: Any) -> dict[str, Any]:
    return {"apiVersion": KUEUE, "kind": kind, "metadata": {"name": name}, **fields}


@pytest.fixture(scope="module")
def kueue(stack: Stack, operator_installed: str) -> Iterator[None]:
    if not stack.images.kueue:
        pytest.skip("CTJ_KUEUE_IMAGE is not set: hack/containers/images.sh builds Kueue's")
    manifests = stack.install_kueue(control_plane=bool(stack.control_plane_nodes()))
    stack.restart_operator(operator_installed)  # it drives Kueue's API where served at start
    quota = [{"name": "cpu", "nominalQuota": "100"}, {"name": "memory", "nominalQuota": "1Ti"},
             {"name": "pods", "nominalQuota": "3"}]  # fmt: skip
    stack.apply([
        _kueue_object("ResourceFlavor", "ctj-e2e", spec={}),
        _kueue_object("ClusterQueue", "ctj-e2e", spec={
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [{"coveredResources": ["cpu", "memory", "pods"],
                                "flavors": [{"name": "ctj-e2e", "resources": quota}]}],
        }),
        _kueue_object("WorkloadPriorityClass", "low", value=100),
        _kueue_object("WorkloadPriorityClass", "high", value=1000),
    ])  # fmt: skip
    try:
        yield
    finally:
        stack.uninstall_kueue(manifests)
        stack.restart_operator(operator_installed)


def _queued(stack: Stack, name: str, priority: str, replicas: int, minimum: int) -> dict[str, Any]:
    job = stack.example_job(name, **TRAINING, **NO_STANDBY)
    job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": QUEUE,
                                 "kueue.x-k8s.io/priority-class": priority}  # fmt: skip
    job["spec"].update(replicas=replicas, minReplicas=minimum, maxReplicas=max(replicas, 3))
    job["spec"].pop("spares", None)
    return job


def _workload(stack: Stack, ns: str, job: str) -> dict[str, Any]:
    found = stack.custom.list_namespaced_custom_object(
        "kueue.x-k8s.io",
        "v1beta2",
        ns,
        "workloads",
        label_selector=f"training.ctj.dev/job-name={job}",
    )["items"]
    assert len(found) == 1, [w["metadata"]["name"] for w in found]
    return dict(found[0])


def _waits_for_admission(stack: Stack, ns: str, job: str) -> None:
    def queued() -> bool:
        st = stack.status(ns, job)
        said = condition(st, "Queued")
        return st.get("phase") == "Pending" and said.get("reason") == "WaitingForAdmission"

    stack.wait(queued, f"{job} Pending, Queued: WaitingForAdmission", 60)
    assert QUEUE in condition(stack.status(ns, job), "Queued").get("message", "")
    assert not stack.pods(ns, job), "no pod before Kueue admits the job"


def test_queued_admitted_in_part_preempted_with_a_checkpoint_suspended_and_resumed(
    stack: Stack, kueue: None, job_namespace: str
) -> None:
    ns = job_namespace
    stack.apply([{**_kueue_object("LocalQueue", QUEUE), "spec": {"clusterQueue": "ctj-e2e"}}],
                namespace=ns)  # fmt: skip
    stack.apply_job(ns, _queued(stack, "low", "low", 4, 2))
    st = stack.wait_running(ns, "low", 3, after=0)
    admission = _workload(stack, ns, "low")["status"]["admission"]
    assert admission["podSetAssignments"][0]["count"] == 3, admission  # of the 4 asked

    def ready() -> bool:
        status = _workload(stack, ns, "low").get("status") or {}
        return condition(status, "PodsReady").get("status") == "True"

    stack.wait(ready, "low's Workload PodsReady", 60)
    stack.apply_job(ns, _queued(stack, "mid", "low", 1, 1))
    _waits_for_admission(stack, ns, "mid")
    stack.wait(lambda: (stack.status(ns, "low").get("lastCheckpoint") or {}).get("step"),
               "a committed checkpoint of low", 180)  # fmt: skip
    attempt = int(st["attempt"])

    stack.apply_job(ns, _queued(stack, "high", "high", 1, 1))
    stack.wait_running(ns, "high", 1, after=0)

    def said_so() -> bool:  # Events are posted behind the status writes
        said = {(e.reason, e.message) for e in stack.events(ns, "low")}
        return any(r == "CheckpointRequested" and "Preempted" in m for r, m in said) and any(
            r == "Evicted" and "checkpointed and stopped" in m for r, m in said
        )

    stack.wait(said_so, "low's Events: asked to checkpoint, then checkpointed and stopped", 30)

    committed = int((stack.status(ns, "low").get("lastCheckpoint") or {}).get("step", 0))
    st = stack.wait_running(ns, "low", 2, after=attempt)
    restored, first = stack.restored(ns, "low", int(st["attempt"]))
    assert restored["world_size"] == 2 and restored["step"] >= committed, restored
    assert first["step"] == restored["step"] + 1
    assert (st.get("restarts", 0), st.get("nodeRestarts", 0)) == (0, 0), "counted nowhere"
    admission = _workload(stack, ns, "low")["status"]["admission"]
    assert admission["podSetAssignments"][0]["count"] == 2, admission
    _waits_for_admission(stack, ns, "mid")  # the quota is low's 2 and high's 1

    stack.delete_job(ns, "high")  # its quota goes to the job waiting
    stack.wait_running(ns, "mid", 1, after=0)

    attempt = int(st["attempt"])
    stack.suspend(ns, "low", True)
    stack.wait(lambda: stack.status(ns, "low").get("phase") == "Suspended", "low Suspended", 120)
    said = condition(stack.status(ns, "low"), "Suspended").get("message", "")
    assert "checkpointed and stopped" in said, said
    stack.wait(lambda: not stack.pods(ns, "low"), "every pod of the suspended low gone", 60)

    def released() -> bool:  # a suspended job holds no quota: its Workload is deleted
        found = stack.custom.list_namespaced_custom_object(
            *KUEUE_API, ns, "workloads", label_selector="training.ctj.dev/job-name=low"
        )["items"]
        return not found

    stack.wait(released, "low's Workload gone while it is suspended", 60)
    committed = int((stack.status(ns, "low").get("lastCheckpoint") or {}).get("step", 0))
    stack.suspend(ns, "low", False)
    st = stack.wait_running(ns, "low", 2, after=attempt)  # 3 pods of quota, mid holds 1
    restored, _ = stack.restored(ns, "low", int(st["attempt"]))
    assert restored["world_size"] == 2 and restored["step"] >= committed, restored

    for job in ("low", "mid"):  # their Workloads go with them (owner references)
        stack.delete_job(ns, job)

    def gone() -> bool:
        return not stack.custom.list_namespaced_custom_object(*KUEUE_API, ns, "workloads")["items"]

    stack.wait(gone, "the jobs' Workloads gone", 60)
