"""Queued by the real Kueue (v0.19, its manager built here from its Go module) on simulated
nodes: a job labelled with a LocalQueue starts only once admitted, at the size admitted,
with what the admitted ResourceFlavor adds to its pods; a higher-priority job preempts it,
and it checkpoints before its pods go (0 steps lost), gives its quota back, and resumes
resharded at the size Kueue admits it again (partial admission).

The ClusterQueue holds 3 pods (Kueue's ``pods`` resource; cpu and memory ample): job
``low`` (priority 100, 3 ranks, at least 2) takes them all; job ``high`` (priority 1000,
1 rank) preempts it; ``low`` comes back at 2. Once ``high`` has ended, ``low`` is scaled
to 4: a resize asks Kueue again (a new Workload), which admits 3.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.kueue import KueueController
from ctj_stack.jobs import (
    FAST_TRAINING,
    OperatorProcess,
    create_job,
    custom,
    job_events,
    job_manifest,
    job_pods,
    running,
    status,
    wait_for,
)

from tests.cluster.operator_env import kueue_build
from tests.cluster.test_operator_transitions import assert_planned_handover

pytestmark = pytest.mark.cluster

KUEUE = ("kueue.x-k8s.io", "v1beta2")
TOLERATION = {"key": "ctj.dev/test-flavor", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def kueue(op_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """Kueue's CRDs and manager, before the operator starts (it watches Workloads then),
    and one ClusterQueue of 3 pods with its flavor."""
    controller = KueueController(op_cluster, tmp_path_factory.mktemp("kueue"), kueue_build())
    controller.install()
    controller.start()
    api = custom(op_cluster)
    flavor = {"apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor",
              "metadata": {"name": "ctj-test"}, "spec": {"tolerations": [TOLERATION]}}  # fmt: skip
    queue = {
        "apiVersion": "/".join(KUEUE),
        "kind": "ClusterQueue",
        "metadata": {"name": "ctj-test"},
        "spec": {
            "namespaceSelector": {},
            "preemption": {"withinClusterQueue": "LowerPriority"},
            "resourceGroups": [
                {
                    "coveredResources": ["cpu", "memory", "pods"],
                    "flavors": [
                        {
                            "name": "ctj-test",
                            "resources": [
                                {"name": "cpu", "nominalQuota": "100"},
                                {"name": "memory", "nominalQuota": "1000Gi"},
                                {"name": "pods", "nominalQuota": "3"},
                            ],
                        }
                    ],
                }
            ],
        },
    }
    api.create_cluster_custom_object(*KUEUE, "resourceflavors", flavor)
    api.create_cluster_custom_object(*KUEUE, "clusterqueues", queue)
    for name, value in (("low", 100), ("high", 1000)):
        wpc = {"apiVersion": "/".join(KUEUE), "kind": "WorkloadPriorityClass",
               "metadata": {"name": name}, "value": value}  # fmt: skip
        api.create_cluster_custom_object(*KUEUE, "workloadpriorityclasses", wpc)
    try:
        yield controller
    finally:
        controller.stop()
        print("---- kueue log (tail) ----\n" + controller.log_tail())


def _workload(cluster: Cluster, ns: str, job: str) -> dict[str, Any]:
    found = custom(cluster).list_namespaced_custom_object(
        *KUEUE, ns, "workloads", label_selector=f"training.ctj.dev/job-name={job}"
    )["items"]
    assert len(found) == 1, [w["metadata"]["name"] for w in found]
    return dict(found[0])


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (obj.get("status") or {}).get("conditions") or []}


def _true(obj: dict[str, Any], kind: str) -> bool:
    return _conditions(obj).get(kind, {}).get("status") == "True"


def test_a_preempted_job_checkpoints_first_and_resumes_at_the_size_kueue_admits(
    op_cluster: Cluster,
    kueue: Any,
    operator: OperatorProcess,
    job_namespace: str,
    s3_uri: str,
    s3_env: dict[str, str],
) -> None:
    ns, endpoint = job_namespace, s3_env["AWS_ENDPOINT_URL"]
    custom(op_cluster).create_namespaced_custom_object(*KUEUE, ns, "localqueues", {
        "apiVersion": "/".join(KUEUE), "kind": "LocalQueue",
        "metadata": {"name": "team"}, "spec": {"clusterQueue": "ctj-test"}})  # fmt: skip

    def queued(name: str, priority: str, replicas: int, minimum: int) -> None:
        job = job_manifest(name, s3_uri, endpoint, env=FAST_TRAINING, replicas=replicas,
                           minReplicas=minimum, maxReplicas=3)  # fmt: skip
        job["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "team",
                                     "kueue.x-k8s.io/priority-class": priority}  # fmt: skip
        create_job(op_cluster, ns, job)

    # 1. admitted whole: 3 ranks, its Workload says PodsReady once they run
    queued("low", "low", 3, 2)
    wait_for(lambda: running(op_cluster, ns, "low", 1, 3), "low admitted and running at 3", 180)
    workload = _workload(op_cluster, ns, "low")
    assert workload["spec"]["podSets"][0]["count"] == 3
    assert workload["spec"]["podSets"][0]["minCount"] == 2
    assert workload["spec"]["priority"] == 100
    assert workload["metadata"]["ownerReferences"][0]["kind"] == "CheckpointedTrainingJob"
    pods = job_pods(op_cluster, ns, "low")
    flavored = [{(t.key, t.operator, t.effect) for t in p.spec.tolerations or []} for p in pods]
    assert all(("ctj.dev/test-flavor", "Exists", "NoSchedule") in f for f in flavored), flavored
    wait_for(lambda: _true(_workload(op_cluster, ns, "low"), "PodsReady"), "PodsReady", 30)
    wait_for(lambda: (status(op_cluster, ns, "low").get("lastCheckpoint") or {}).get("step"),
             "a committed checkpoint of low", 120)  # fmt: skip

    # 2. a higher priority takes a pod: low checkpoints, stops, gives its quota back
    before = status(op_cluster, ns, "low")
    queued("high", "high", 1, 1)
    wait_for(lambda: running(op_cluster, ns, "high", 1, 1), "high admitted and running", 180)

    def asked_to_checkpoint() -> bool:  # Events are posted behind the status write
        said = {(e.reason, e.message) for e in job_events(op_cluster, ns, "low")}
        return any(r == "CheckpointRequested" and "Preempted" in m for r, m in said)

    wait_for(asked_to_checkpoint, "low's Event: a checkpoint asked for, naming the preemption", 30)

    # 3. low is admitted again at what is left (2 of its 3: partial admission), restores
    # exactly the step it stopped at, resharded 3 -> 2
    attempt = int(before["attempt"]) + 1
    st = wait_for(lambda: running(op_cluster, ns, "low", attempt, 2), "low back at 2", 180)
    counts = ("restarts", "nodeRestarts")
    assert [st.get(k, 0) for k in counts] == [before.get(k, 0) for k in counts], "uncounted"
    admission = (_workload(op_cluster, ns, "low")["status"] or {})["admission"]
    assert admission["podSetAssignments"][0]["count"] == 2, admission
    assert_planned_handover(op_cluster, ns, "low", 2, before=attempt - 1)

    # 4. a finished job's quota goes back: high's Workload is Finished once high is
    custom(op_cluster).patch_namespaced_custom_object(
        "training.ctj.dev", "v1alpha1", ns, "checkpointedtrainingjobs", "high",
        {"spec": {"activeDeadlineSeconds": 1}})  # fmt: skip
    wait_for(lambda: _true(_workload(op_cluster, ns, "high"), "Finished"),
             "high's Workload Finished once high failed its deadline", 60)  # fmt: skip

    # 5. `kubectl scale` asks Kueue again: low (at 2, its Workload asking for 3) is scaled
    # to 4; it checkpoints and stops, its Workload is made again for 4, and Kueue, with
    # high's quota back, admits 3 of them: low resumes at 3 exactly where it stopped
    before = status(op_cluster, ns, "low")
    custom(op_cluster).patch_namespaced_custom_object(
        "training.ctj.dev", "v1alpha1", ns, "checkpointedtrainingjobs", "low",
        {"spec": {"replicas": 4, "maxReplicas": 4}})  # fmt: skip
    attempt = int(before["attempt"]) + 1
    wait_for(lambda: running(op_cluster, ns, "low", attempt, 3), "low admitted again at 3", 180)
    workload = _workload(op_cluster, ns, "low")
    assert workload["spec"]["podSets"][0]["count"] == 4
    assert workload["status"]["admission"]["podSetAssignments"][0]["count"] == 3
    assert_planned_handover(op_cluster, ns, "low", 3, before=attempt - 1)
