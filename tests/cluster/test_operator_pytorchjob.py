"""Backend pytorchjob against the real Kubeflow controller (training-operator v1.8.1, built
from its Go module by hack/cluster-binaries.sh, run out of cluster with its own RBAC).

The operator creates one PyTorchJob per attempt; the controller creates the Master and
Worker pods, their headless Services and the rendezvous environment; the trainers train
and checkpoint through the sidecar; a killed node ends the attempt, and the next one
restores resharded at the new world size. Nothing here writes a PyTorchJob's status.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from ctj_devcluster import Cluster
from ctj_devcluster.kubeflow import KubeflowController
from ctj_operator.builders import master_port
from ctj_stack.jobs import (
    FAST_TRAINING,
    NewJob,
    committed_steps,
    core,
    custom,
    job_pods,
    running,
    status,
    trainer_events,
    wait_for,
    wait_resumed,
)
from kubernetes.client.exceptions import ApiException

from tests.cluster.operator_env import kubeflow_build

pytestmark = pytest.mark.cluster
KF = ("kubeflow.org", "v1")
TRAINER = "pytorch"  # the container name a PyTorchJob requires


@pytest.fixture(scope="module")
def kubeflow(op_cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The controller, started before the operator (which then watches PyTorchJobs)."""
    root = tmp_path_factory.mktemp("kubeflow")
    controller = KubeflowController(op_cluster, root, kubeflow_build())
    controller.install()
    controller.start()
    try:
        yield controller
    finally:
        controller.stop()
        print("---- training-operator log (tail) ----\n" + controller.log_tail())
        op_cluster.kubectl("delete", "-f", str(controller.build.crd), "--wait=false")


def _pytorchjob(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    try:
        return custom(cluster).get_namespaced_custom_object(*KF, ns, "pytorchjobs", name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _true_conditions(ptj: dict[str, Any] | None) -> set[str]:
    conditions = ((ptj or {}).get("status") or {}).get("conditions") or []
    return {c["type"] for c in conditions if c.get("status") == "True"}


def _env(pod: Any, container: str = TRAINER) -> dict[str, str]:
    (c,) = [c for c in pod.spec.containers if c.name == container]
    return {e.name: e.value for e in c.env or [] if e.value is not None}


def _attempt_pods(cluster: Cluster, ns: str, name: str, attempt: int) -> dict[str, Any]:
    prefix = f"{name}-a{attempt}-"
    pods = job_pods(cluster, ns, name)
    return {p.metadata.name: p for p in pods if p.metadata.name.startswith(prefix)}


def test_the_kubeflow_controller_runs_each_attempt_and_a_lost_node_restarts_it_resharded(
    op_cluster: Cluster, kubeflow: Any, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "kf"
    job = new_job(
        name,
        backend="pytorchjob",
        replicas=3,
        env=FAST_TRAINING,
        restartPolicy={"maxRestarts": 3, "backoffSeconds": 0.5},
    )

    # our PyTorchJob: the controller's rules for names and restarts, our placement
    ptj = wait_for(lambda: _pytorchjob(op_cluster, ns, f"{name}-a1"), "PyTorchJob a1", 30)
    (owner,) = ptj["metadata"]["ownerReferences"]
    assert owner["kind"] == "CheckpointedTrainingJob" and owner["uid"] == job["metadata"]["uid"]
    run_policy = ptj["spec"]["runPolicy"]
    assert run_policy["cleanPodPolicy"] == "None" and "backoffLimit" not in run_policy
    replicas = ptj["spec"]["pytorchReplicaSpecs"]
    assert (replicas["Master"]["replicas"], replicas["Worker"]["replicas"]) == (1, 2)

    # the controller's pods, with its environment, train at world size 3
    st = wait_for(lambda: running(op_cluster, ns, name, 1, 3), "attempt 1 running on 3 nodes", 120)
    assert st.get("restarts", 0) == 0
    pods = _attempt_pods(op_cluster, ns, name, 1)
    master, w0, w1 = f"{name}-a1-master-0", f"{name}-a1-worker-0", f"{name}-a1-worker-1"
    assert set(pods) == {master, w0, w1}
    for pod_name, pod in pods.items():
        (ref,) = pod.metadata.owner_references
        assert (ref.kind, ref.name) == ("PyTorchJob", f"{name}-a1")
        env = _env(pod)
        assert env["MASTER_ADDR"] == master and env["MASTER_PORT"] == str(master_port(1))
        assert env["WORLD_SIZE"] == "3" and env["PYTHONUNBUFFERED"] == "1"
        assert env["RANK"] == {master: "0", w0: "1", w1: "2"}[pod_name]
        inits = [c.name for c in pod.spec.init_containers]
        ours = ["ctj-sidecar"]  # no root init step: the node agents own the node's disk
        assert inits == (ours if pod_name == master else [*ours, "init-pytorch"])
    assert len({p.spec.node_name for p in pods.values()}) == 3, "one rank per node"
    svc = core(op_cluster).read_namespaced_service(master, ns)
    assert svc.spec.cluster_ip == "None", "the controller's headless Service for the master"

    # a checkpoint commits through the sidecars, then the node of rank 1 is lost
    committed = wait_for(
        lambda: committed_steps(op_cluster, ns, master, TRAINER), "a commit at world 3", 120
    )
    staged_in_1 = {
        e["step"] for e in trainer_events(op_cluster, ns, master, TRAINER) if e["event"] == "staged"
    }
    lost_node = pods[w0].spec.node_name
    op_cluster.kill_node(lost_node)

    # Not asserted: that the controller marks PyTorchJob a1 Failed. The operator sees the
    # lost node by its heartbeats (3 s) and deletes a1 itself; whether the controller
    # wrote Failed before that is a race the operator does not depend on (a cold run
    # saw only Created and Running)
    st = wait_for(lambda: running(op_cluster, ns, name, 2, 2), "attempt 2 at world size 2", 120)
    assert (st["nodeRestarts"], st.get("restarts", 0)) == (1, 0), "a lost node is not a crash"
    restarted_why = {c["type"]: c for c in st["conditions"]}["Restarted"]
    assert restarted_why["reason"] in ("HeartbeatLost", "NodeNotReady"), restarted_why
    ptj2 = _pytorchjob(op_cluster, ns, f"{name}-a2")
    assert ptj2 is not None
    assert ptj2["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 1
    pods2 = _attempt_pods(op_cluster, ns, name, 2)
    assert lost_node not in {p.spec.node_name for p in pods2.values()}
    assert _env(pods2[f"{name}-a2-master-0"])["WORLD_SIZE"] == "2"

    # the new master restores resharded 3 -> 2 from attempt 1's last commit, and trains on
    restored, steps = wait_resumed(op_cluster, ns, f"{name}-a2-master-0", TRAINER)
    assert restored["world_size"] == 2 and restored["step"] >= committed[-1]
    assert restored["step"] in staged_in_1
    assert steps[0]["step"] == restored["step"] + 1, "training continues from the checkpoint"

    # attempt 1 is cleaned up: its PyTorchJob, and its pods (the lost node's by force)
    wait_for(lambda: _pytorchjob(op_cluster, ns, f"{name}-a1") is None, "a1 deleted", 60)
    wait_for(lambda: not _attempt_pods(op_cluster, ns, name, 1), "a1's pods gone", 60)
    op_cluster.restart_node(lost_node)


def test_a_short_job_succeeds_and_the_controller_agrees(
    op_cluster: Cluster, kubeflow: Any, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "kfdone"
    new_job(
        name,
        backend="pytorchjob",
        replicas=2,
        env={"CTJ_TOTAL_STEPS": "25", "CTJ_STEP_DELAY_S": "0.05"},
    )
    st = wait_for(
        lambda: (s := status(op_cluster, ns, name)).get("phase") in ("Succeeded", "Failed") and s,
        "the job to end",
        180,
    )
    assert st["phase"] == "Succeeded" and st["attempt"] == 1, st
    assert "Succeeded" in _true_conditions(_pytorchjob(op_cluster, ns, f"{name}-a1"))
    steps = [
        e["step"]
        for e in trainer_events(op_cluster, ns, f"{name}-a1-master-0", TRAINER)
        if e["event"] == "step"
    ]
    assert steps and steps[-1] == 25
