"""A job queued by Kueue, decided and rendered (no cluster): its Workload is made once, no
attempt starts before Kueue admits it and none wider than admitted, the admitted flavor's
placement reaches the pods, PodsReady is said once, an eviction is a planned stop whose
quota is given back once no pod is left, and a finished job's Workload is Finished."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from ctj_operator import builders, queue
from ctj_operator.decisions import (
    CreateAttempt,
    CreateWorkload,
    DeleteWorkload,
    JobState,
    Observation,
    PatchStatus,
    PatchWorkload,
    RequestCheckpoint,
    Restarted,
    Transition,
)
from ctj_operator.queue import Flavor, Queue, WorkloadView, Write
from ctj_operator.render import Kind, Target, Verb, render
from ctj_operator.spec import JobSpec, SpecError

from tests.unit.test_decisions import RUNNING3, TEMPLATE, condition, decide, nodes, observe, pods

LABELS = {queue.QUEUE_LABEL: "team", queue.PRIORITY_LABEL: "high"}
TOLERATION = {"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}


def queued_spec(**kw: Any) -> JobSpec:
    raw: dict[str, Any] = {
        "replicas": 3,
        "minReplicas": 2,
        "maxReplicas": 4,
        "template": TEMPLATE,
        "checkpoint": {"uri": "s3://b/p"},
    }
    return JobSpec.parse({**raw, **kw}, labels=LABELS)


def workload(count: int | None, *conditions: tuple[str, str, str]) -> WorkloadView:
    """The job's Workload as Kueue writes it, read as the operator's index reads it:
    admitted at ``count`` on flavor ``gpus`` (None: not admitted), each of ``conditions``
    (type, reason, message) True."""
    status: dict[str, Any] = {
        "conditions": [
            {"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions
        ]
    }
    if count is not None:
        assigned = {"name": "ranks", "count": count, "flavors": {"cpu": "gpus"}}
        status["admission"] = {"clusterQueue": "cq", "podSetAssignments": [assigned]}
    body = {"metadata": {"name": "job-ctj", "resourceVersion": "7"},
            "spec": {"podSets": [{"name": "ranks", "count": 3}]}, "status": status}  # fmt: skip
    return queue.workload_view(body)


def admitted(count: int, *more: tuple[str, str, str]) -> WorkloadView:
    return workload(count, ("QuotaReserved", "QuotaReserved", ""), ("Admitted", "Admitted", ""),
                    *more)  # fmt: skip


def with_queue(obs: Observation, found: WorkloadView | None) -> Observation:
    flavors = {"gpus": Flavor({"pool": "a100"}, (TOLERATION,))}
    return dataclasses.replace(
        obs, queue=queue.queue_of("team", found, flavors, "high", {"high": 1000})
    )


def written(action: PatchWorkload) -> dict[str, Any]:
    """The status the Workload write sends (rendered as apply sends it)."""
    (call,) = render(action, Target(body=_job(), spec=queued_spec()))
    assert (call.verb, call.kind, call.name) == (Verb.STATUS, Kind.WORKLOAD, "job-ctj")
    assert call.body["metadata"]["resourceVersion"] == "7", "conditional on the view"
    status: dict[str, Any] = dict(call.body["status"])
    return status


def test_the_labels_name_the_queue_and_a_spare_outside_its_quota_is_refused() -> None:
    spec = queued_spec()
    assert (spec.queue, spec.priority_class) == ("team", "high")
    with pytest.raises(SpecError, match="spec.spares"):
        queued_spec(spares=1, restartPolicy={"inPlace": True})


def test_nothing_starts_before_admission_and_the_workload_is_made_once() -> None:
    obs = with_queue(observe(JobState(), [], nodes(3), 1.0, job=queued_spec()), None)
    plan = decide(obs)
    made = [a for a in plan.actions if isinstance(a, CreateWorkload)]
    assert made == [CreateWorkload(3, 2, ("high", 1000))]
    assert not any(isinstance(a, CreateAttempt) for a in plan.actions)
    assert condition(plan.status(), "Queued")["reason"] == "WaitingForAdmission"
    waiting = workload(None)
    later = decide(with_queue(observe(JobState(), [], nodes(3), 2.0, job=queued_spec()), waiting))
    assert not any(isinstance(a, CreateWorkload | CreateAttempt) for a in later.actions)


def test_without_kueue_the_job_waits_saying_so() -> None:
    obs = observe(JobState(), [], nodes(3), 1.0, job=queued_spec())
    plan = decide(dataclasses.replace(obs, queue=Queue("team", installed=False)))
    queued = condition(plan.status(), "Queued")
    assert queued["reason"] == "KueueNotServed" and "remove the label" in queued["message"]
    assert not any(isinstance(a, CreateWorkload | CreateAttempt) for a in plan.actions)


def test_admitted_it_starts_at_the_admitted_count_on_the_flavor() -> None:
    obs = with_queue(observe(JobState(), [], nodes(3), 1.0, job=queued_spec()), admitted(2))
    created = next(a for a in decide(obs).actions if isinstance(a, CreateAttempt))
    assert created.world_size == 2, "partial admission: no wider than Kueue admitted"
    assert dict(created.node_labels) == {"pool": "a100"}
    assert list(created.tolerations) == [TOLERATION]
    target = Target(body=_job(), spec=queued_spec(), uri="s3://b/p/ns/job-uid")
    pods_made = [c.body for c in render(created, target) if c.kind == Kind.POD]
    assert len(pods_made) == 2
    assert all(p["spec"]["nodeSelector"]["pool"] == "a100" for p in pods_made)
    assert all(TOLERATION in p["spec"]["tolerations"] for p in pods_made)


def test_pods_ready_is_said_once_every_rank_runs() -> None:
    running = dataclasses.replace(RUNNING3, healthy_since=-50.0)
    obs = with_queue(observe(running, pods(3), nodes(3), 1.0, job=queued_spec()), admitted(3))
    said = [a for a in decide(obs).actions if isinstance(a, PatchWorkload)]
    assert len(said) == 1 and said[0].write is Write.READY
    ready = condition(written(said[0]), "PodsReady")
    assert (ready["status"], ready["reason"]) == ("True", "Started")
    done = admitted(3, ("PodsReady", "Started", ""))
    again = decide(with_queue(observe(running, pods(3), nodes(3), 2.0, job=queued_spec()), done))
    assert not any(isinstance(a, PatchWorkload) for a in again.actions)


def test_an_eviction_checkpoints_first_and_the_quota_goes_back_once_no_pod_is_left() -> None:
    evicted = admitted(3, ("Evicted", "Preempted", "by high"))
    obs = with_queue(observe(RUNNING3, pods(3), nodes(3), 5.0, job=queued_spec()), evicted)
    asked = decide(obs)
    assert any(isinstance(a, RequestCheckpoint) for a in asked.actions)
    t = asked.status()["transition"]
    assert t["reason"] == "Evicted" and "Preempted" in t["message"]
    waiting = dataclasses.replace(
        RUNNING3, transition=Transition(t["reason"], t["message"], 5.0, t["requestId"])
    )
    stopped = with_queue(observe(waiting, pods(3, "Succeeded"), nodes(3), 9.0, job=queued_spec()),
                         evicted)  # fmt: skip
    done = decide(stopped)
    assert not any(isinstance(a, Restarted) for a in done.actions), "not a restart"
    assert (done.status()["restarts"], done.status()["nodeRestarts"]) == (0, 0)

    # pods still going: the quota is held; gone: given back, and the job waits queued
    torn = JobState(phase="Restarting", attempt=1, world_size=3, torn_down=True)
    lingering = decide(with_queue(observe(torn, pods(3, "Succeeded"), nodes(3), 10.0,
                                          job=queued_spec()), evicted))  # fmt: skip
    assert not any(isinstance(a, PatchWorkload) for a in lingering.actions)
    gone = decide(with_queue(observe(torn, [], nodes(3), 11.0, job=queued_spec()), evicted))
    (release,) = [a for a in gone.actions if isinstance(a, PatchWorkload)]
    status = written(release)
    assert status["admission"] is None
    by_type = {c["type"]: c for c in status["conditions"]}
    assert by_type["QuotaReserved"]["status"] == "False"
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"]["status"] == "True", "Kueue's own condition is left alone"
    first = next(i for i, a in enumerate(gone.actions) if isinstance(a, PatchStatus))
    assert first < gone.actions.index(release), "a stale view gives nothing back"
    assert not any(isinstance(a, CreateAttempt) for a in gone.actions)


def test_a_finished_job_finishes_its_workload_and_a_suspended_one_deletes_it() -> None:
    ok = {"type": "Succeeded", "status": "True", "reason": "Completed", "message": "ok"}
    done = JobState(phase="Succeeded", attempt=1, world_size=3, conditions=(ok,))
    plan = decide(with_queue(observe(done, [], nodes(3), 1.0, job=queued_spec()), admitted(3)))
    (finish,) = [a for a in plan.actions if isinstance(a, PatchWorkload)]
    assert condition(written(finish), "Finished")["reason"] == "Succeeded"
    suspended = JobState(phase="Restarting", attempt=1, world_size=3, torn_down=True)
    obs = observe(suspended, [], nodes(3), 1.0, job=queued_spec(suspend=True))
    paused = decide(with_queue(obs, admitted(3)))
    assert DeleteWorkload("job-ctj") in paused.actions


def test_the_workload_carries_the_rank_pod_its_quota_is_counted_on() -> None:
    call = render(CreateWorkload(3, 2, ("high", 1000)), Target(body=_job(), spec=queued_spec()))
    (create,) = call
    assert (create.verb, create.kind) == (Verb.CREATE, Kind.WORKLOAD)
    workload = dict(create.body)
    assert workload["apiVersion"] == "kueue.x-k8s.io/v1beta2"
    assert workload["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    spec = workload["spec"]
    assert spec["queueName"] == "team" and spec["priority"] == 1000
    assert spec["priorityClassRef"]["name"] == "high"
    (pod_set,) = spec["podSets"]
    assert (pod_set["count"], pod_set["minCount"]) == (3, 2)
    made = builders.build_pod(_job(), queued_spec(), uri="", attempt=0, world_size=3, node_rank=0)
    assert pod_set["template"]["spec"]["initContainers"] == made["spec"]["initContainers"]


def _job() -> dict[str, Any]:
    return {
        "apiVersion": "training.ctj.dev/v1alpha1",
        "kind": "CheckpointedTrainingJob",
        "metadata": {"name": "job", "namespace": "ns", "uid": "uid-1", "labels": LABELS},
    }


def test_a_workload_as_kueue_writes_it_is_read_into_its_view() -> None:
    body = {
        "metadata": {"name": "job-ctj", "resourceVersion": "42"},
        "spec": {"podSets": [{"name": "ranks", "count": 4, "minCount": 2}]},
        "status": {
            "admission": {
                "clusterQueue": "cq",
                "podSetAssignments": [
                    {"name": "ranks", "count": 3, "flavors": {"cpu": "b", "memory": "a"}}
                ],
            },
            "conditions": [
                {"type": "QuotaReserved", "status": "True"},
                {"type": "Admitted", "status": "True"},
            ],
        },
    }
    view = queue.workload_view(body)
    assert (view.admitted, view.admitted_count, view.count) == (True, 3, 4)
    assert view.flavors == ("a", "b") and view.resource_version == "42"
    assert (view.quota_reserved, view.evicted, view.pods_ready) == (True, "", False)
    pending = queue.workload_view({**body, "status": {"conditions": []}})
    assert not pending.admitted and pending.admitted_count is None
    flavors = {"a": Flavor({"x": "1"}), "b": Flavor({"y": "2"}, (TOLERATION,))}
    both = queue.queue_of("q", view, flavors, "gone", {})
    assert (dict(both.node_labels), list(both.tolerations)) == ({"x": "1", "y": "2"}, [TOLERATION])
    assert both.priority is None and both.priority_missing == "gone"


@pytest.mark.parametrize("replicas", [2, 4], ids=["shrink", "grow"])
def test_a_resize_stops_with_a_checkpoint_and_asks_kueue_again(replicas: int) -> None:
    """`kubectl scale` of a queued job: Kueue v0.19 resizes no admission in place for a
    kind it does not compile in, so the attempt stops as a planned transition (every rank
    checkpoints, nothing counted), the Workload of the old size goes (its quota back) once
    no pod is left, and one of the new size waits for Kueue; nothing starts before."""
    spec = queued_spec(replicas=replicas)
    asked = decide(with_queue(observe(RUNNING3, pods(3), nodes(3), 5.0, job=spec), admitted(3)))
    assert any(isinstance(a, RequestCheckpoint) for a in asked.actions)
    t = asked.status()["transition"]
    assert t["reason"] == "Requeued" and f"spec.replicas is {replicas}" in t["message"]

    torn = JobState(phase="Restarting", attempt=1, world_size=3, torn_down=True)
    gone = decide(with_queue(observe(torn, [], nodes(3), 11.0, job=spec), admitted(3)))
    assert DeleteWorkload("job-ctj") in gone.actions
    first = next(i for i, a in enumerate(gone.actions) if isinstance(a, PatchStatus))
    assert first < gone.actions.index(DeleteWorkload("job-ctj")), "a stale view deletes nothing"
    assert not any(isinstance(a, CreateAttempt) for a in gone.actions), "the old admission"
    queued = condition(gone.status(), "Queued")
    assert queued["reason"] == "WaitingForAdmission" and "new size" in queued["message"]
    again = decide(with_queue(observe(torn, [], nodes(3), 12.0, job=spec), None))
    assert CreateWorkload(replicas, 2, ("high", 1000)) in again.actions


def test_a_node_lost_and_back_keeps_the_admission() -> None:
    """Fewer nodes than admitted is no resize of the Workload: the job keeps its quota and
    grows back within it when the node returns, with no new admission."""
    running2 = dataclasses.replace(RUNNING3, world_size=2, healthy_since=-50.0)
    plan = decide(with_queue(observe(running2, pods(2), nodes(2), 5.0, job=queued_spec()),
                             admitted(3, ("PodsReady", "Started", ""))))  # fmt: skip
    assert not any(isinstance(a, DeleteWorkload | RequestCheckpoint) for a in plan.actions)
