"""One job through what ctj is bought for, on a real cluster: the chart installed with
our operator image, the example job on our trainer image checkpointing to the S3 server
in the cluster, a node lost (its container killed) and back, a `kubectl scale`, a delete;
then the same scenario with backend pytorchjob, under Kubeflow's controller.

Each step waits on a condition the user would watch (`kubectl get ctj`, the trainer's
log); the node-loss step records the time from the kill to the first training step after
the restore into $CTJ_E2E_RESULTS (docs/e2e.md quotes it).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import pytest
from ctj_stack import NodeControl, Stack

# Long enough never to finish during the test; slow enough to read, fast enough to save
# every few seconds (the example saves every 10 steps).
TRAINING = {"CTJ_TOTAL_STEPS": "1000000", "CTJ_STEP_DELAY_S": "0.2"}


def _record(result: dict[str, Any]) -> None:
    path = os.environ.get("CTJ_E2E_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")


def test_the_chart_runs_the_operator_with_its_own_rbac(
    stack: Stack, operator_installed: str
) -> None:
    deployment = stack.apps.read_namespaced_deployment("ctj", operator_installed)
    assert deployment.status.ready_replicas == 1
    account = deployment.spec.template.spec.service_account_name
    who = f"system:serviceaccount:{operator_installed}:{account}"
    can = {
        verb: stack.can_i(who, *verb.split())
        for verb in ("create pods", "patch checkpointedtrainingjobs.training.ctj.dev/status",
                     "create secrets", "get secrets", "delete nodes")
    }  # fmt: skip
    assert can == {
        "create pods": True,
        "patch checkpointedtrainingjobs.training.ctj.dev/status": True,
        "create secrets": True,
        "get secrets": False,
        "delete nodes": False,
    }


@pytest.mark.incremental
class TestJobLifecycle:
    """Backend pods: the operator makes each attempt's pods itself."""

    JOB = "demo"
    BACKEND = "pods"
    state: dict[str, Any] = {}

    def test_the_example_job_commits_checkpoints(
        self, stack: Stack, operator_installed: str, job_namespace: str
    ) -> None:
        ns, name = job_namespace, self.JOB
        stack.apply_job(ns, stack.example_job(name, self.BACKEND, **TRAINING))

        def committed() -> dict[str, Any] | None:
            st = stack.running(ns, name, 3)
            return st if st and (st.get("lastCheckpoint") or {}).get("step", 0) >= 20 else None

        st = stack.wait(committed, "3 pods running, a checkpoint committed", 600,
                        lambda: stack.describe(ns, name))  # fmt: skip
        table = stack.kubectl("get", "ctj", name, "-n", ns).splitlines()
        header, row = table[0].split(), dict(zip(table[0].split(), table[1].split(), strict=False))
        assert "STEP" in header and int(row["STEP"]) >= st["lastCheckpoint"]["step"]
        assert row["PHASE"] == "Running" and row["WORLD"] == "3"
        if self.BACKEND == "pytorchjob":  # the controller's pods, owned by our PyTorchJob
            for pod in stack.attempt_pods(ns, name, st["attempt"]):
                (owner,) = pod.metadata.owner_references
                assert (owner.kind, owner.name) == ("PyTorchJob", f"{name}-a{st['attempt']}")
        self.state["attempt"] = st["attempt"]

    def test_a_lost_node_restarts_the_job_at_two_from_its_last_checkpoint(
        self, stack: Stack, job_namespace: str, node_control: NodeControl
    ) -> None:
        ns, attempt = job_namespace, self.state["attempt"]
        pods = stack.attempt_pods(ns, self.JOB, attempt)
        victim = stack.victim(ns, self.JOB, attempt)
        node = stack.node_of(victim)
        committed_before = stack.status(ns, self.JOB)["lastCheckpoint"]["step"]
        before = {p.metadata.name: stack.trainer_events(ns, p.metadata.name) for p in pods}
        killed_at = time.time()
        stack.log(f"stopping node {node} (it runs {victim.metadata.name})")
        node_control.stop_node(node)
        self.state["node"] = node

        st = stack.wait_running(ns, self.JOB, 2, after=attempt)
        restored, first = stack.restored(ns, self.JOB, st["attempt"])
        step = restored["step"]
        assert step >= committed_before, "a committed checkpoint was lost"
        assert restored["world_size"] == 2 and first["step"] == step + 1
        for pod in stack.attempt_pods(ns, self.JOB, st["attempt"]):
            assert stack.node_of(pod) != node
        # the loss the restored model computes is the one the saved model computed
        staged = {
            e["step"]: e["eval_loss"]
            for events in before.values()
            for e in events
            if e["event"] == "staged" and "eval_loss" in e
        }
        if step in staged:  # else it was staged in the instant between the log read and the kill
            assert restored["eval_loss"] == pytest.approx(staged[step], rel=1e-4)
        result = {
            "scenario": "node_loss",
            "backend": self.BACKEND,
            "kill_to_first_step_s": round(first["t"] - killed_at, 1),
            "restored_step": step,
            "committed_before_kill": committed_before,
            "restore_seconds": restored["seconds"],
            "bytes_by_tier": restored.get("bytes_by_tier"),
            "loss_before": staged.get(step),
            "loss_after": restored["eval_loss"],
        }
        stack.log(f"node loss: {json.dumps(result)}")
        _record(result)
        self.state["attempt"] = st["attempt"]

    def test_the_node_comes_back_and_the_job_grows_to_three(
        self, stack: Stack, job_namespace: str, node_control: NodeControl
    ) -> None:
        ns, attempt, node = job_namespace, self.state["attempt"], self.state["node"]
        started = time.time()
        node_control.start_node(node)
        stack.wait(lambda: stack.node_back(node, started), f"node {node}'s kubelet back", 300)
        st = stack.wait_running(ns, self.JOB, 3, after=attempt)
        restored, first = stack.restored(ns, self.JOB, st["attempt"])
        assert restored["world_size"] == 3 and first["step"] == restored["step"] + 1
        self.state["attempt"] = st["attempt"]

    def test_kubectl_scale_resizes_the_job(self, stack: Stack, job_namespace: str) -> None:
        ns, attempt = job_namespace, self.state["attempt"]
        world = 2 if stack.status(ns, self.JOB)["worldSize"] == 3 else 3
        stack.kubectl("scale", f"ctj/{self.JOB}", f"--replicas={world}", "-n", ns)
        st = stack.wait_running(ns, self.JOB, world, after=attempt)
        restored, first = stack.restored(ns, self.JOB, st["attempt"])
        assert restored["world_size"] == world and first["step"] == restored["step"] + 1

    def test_deleting_the_job_removes_every_child(self, stack: Stack, job_namespace: str) -> None:
        ns = job_namespace
        assert stack.children(ns, self.JOB), "the job has no children to remove"
        stack.delete_job(ns, self.JOB)
        stack.wait(lambda: not stack.children(ns, self.JOB), "every child of the job to go", 180,
                   lambda: "\n".join(stack.children(ns, self.JOB)))  # fmt: skip


class TestPytorchJobLifecycle(TestJobLifecycle):
    """Backend pytorchjob: each attempt is a PyTorchJob, whose pods, Services and
    rendezvous environment Kubeflow's controller makes (and whose spec its webhook
    validates); the operator still decides every attempt and its world size."""

    JOB = "demo-kf"
    BACKEND = "pytorchjob"
    state: dict[str, Any] = {}

    @pytest.fixture(autouse=True)
    def _kubeflow(self, kubeflow: str) -> None:
        if kubeflow:
            pytest.skip(f"backend pytorchjob: {kubeflow}")
