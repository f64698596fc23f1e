"""Observe: what the watches deliver, reduced to the ``Observation`` the decisions read.

kopf keeps an index per watched kind (handlers.py registers them); each index entry is one
of the small dicts made here, so the reconcile reads memory, not the API server
(``observe`` builds one job's view from them, where a rank of it fits included). Ranks'
heartbeats (heartbeats.py) and kubelet Leases are judged by when *this process* saw them
(``Freshness``), never by comparing another machine's clock with ours.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeAlias

from ctj_contract import (
    ANNOTATION_AVOID,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_LAUNCHER,
    LABEL_RANK,
    LABEL_SPARE,
)
from ctj_contract.launch import WorkerExit

from . import capacity
from .builders import (
    CONTROLLED,
    JOB_COMPLETION_INDEX,
    KF_REPLICA_INDEX,
    KF_REPLICA_TYPE,
    attempt_name,
    controller_failure,
    rank_footprint,
)
from .decisions import JobState, NodeView, Observation, PodView
from .queue import Flavor, Queue, WorkloadView, queue_of
from .spec import Backend, JobSpec


def node_rank(labels: Mapping[str, str]) -> int:
    """Our pods carry their rank; the Kubeflow controller's carry its replica type and
    index (the master is rank 0, worker i is rank i + 1, as it sets RANK); a TrainJob's,
    their Indexed Job's completion index."""
    if LABEL_RANK in labels:
        return int(labels[LABEL_RANK])
    if JOB_COMPLETION_INDEX in labels:
        return int(labels[JOB_COMPLETION_INDEX])
    if labels.get(KF_REPLICA_TYPE) == "worker":
        return int(labels.get(KF_REPLICA_INDEX, "0")) + 1
    return 0


EXIT_MESSAGE_CHARS = 300
"""How much of a container's termination message a condition quotes (its last line)."""


def container_exit(status: Mapping[str, Any]) -> str:
    """Why a container of the pod (the trainer, not our init containers) ended in failure:
    ``trainer exited 1: <the last line of its termination message>``, or "". The message
    is the container's own, or its last log lines (terminationMessagePolicy
    FallbackToLogsOnError, which builders set on the trainer)."""
    for cs in status.get("containerStatuses") or []:
        ended = (cs.get("state") or {}).get("terminated") or {}
        code = ended.get("exitCode")
        if not ended or code == 0:
            continue
        lines = [line.strip() for line in str(ended.get("message") or "").splitlines()]
        last = next((line for line in reversed(lines) if line), "")
        if len(last) > EXIT_MESSAGE_CHARS:
            last = last[: EXIT_MESSAGE_CHARS - 3] + "..."
        what = f"exited {code}" if code is not None else "ended"
        reason = ended.get("reason")
        if reason and reason != "Error":  # e.g. OOMKilled
            what += f" ({reason})"
        return f"{cs.get('name')} {what}" + (f": {last}" if last else "")
    return ""


def pod_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """One pod of a ctj job, as the job's index keeps it."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    labels = meta.get("labels") or {}
    waiting = ""
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            waiting = cond.get("message") or cond.get("reason") or ""
    for cs in status.get("containerStatuses") or []:
        w = (cs.get("state") or {}).get("waiting") or {}
        if w.get("reason") and not waiting:
            waiting = f"{cs.get('name')}: {w['reason']}" + (
                f" ({w['message']})" if w.get("message") else ""
            )
    containers = status.get("containerStatuses") or []
    return {
        "exit": container_exit(status),
        # every main container (the trainer) ended: the kubelet is stopping its sidecar
        "finished": bool(containers)
        and all((cs.get("state") or {}).get("terminated") for cs in containers),
        "name": meta["name"],
        "attempt": int(labels.get(LABEL_ATTEMPT, "0")),
        "rank": node_rank(labels),
        "phase": status.get("phase") or "Pending",
        "node": spec.get("nodeName"),
        "ip": status.get("podIP"),
        "terminating": meta.get("deletionTimestamp") is not None,
        "reason": status.get("reason"),
        "waiting": waiting,
        "launcher": labels.get(LABEL_LAUNCHER) == "true",
        "spare": labels.get(LABEL_SPARE) == "true",
        "avoid": [
            n for n in (meta.get("annotations") or {}).get(ANNOTATION_AVOID, "").split(",") if n
        ],
    }


def pod_view(
    s: Mapping[str, Any],
    phase_age: float | None = None,
    *,
    worker: tuple[WorkerExit, float | None] | None = None,
) -> PodView:
    """``worker``: how the pod's worker of this attempt ended while its launcher keeps the
    pod running (as its sidecar reported it), and how long ago that was seen: the rank
    reads Failed, as a pod whose trainer ended would, and stays relaunchable."""
    phase, exit_, age = s["phase"], s.get("exit", ""), phase_age
    running = phase == "Running" and not s["terminating"]
    if worker is not None and running and worker[0].attempt == s["attempt"]:
        phase, exit_, age = "Failed", worker[0].describe(), worker[1]
    return PodView(
        name=s["name"],
        attempt=s["attempt"],
        node_rank=s["rank"],
        phase=phase,
        node_name=s["node"],
        terminating=s["terminating"],
        reason=s["reason"],
        exit=exit_,  # absent from a summary an older operator indexed
        finished=s.get("finished", False),
        waiting=s["waiting"],
        phase_age=age,
        relaunchable=running and s.get("launcher", False),
        spare=s.get("spare", False),
        avoid=tuple(s.get("avoid") or ()),
    )


def node_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """What capacity.py needs of a Node (name, labels, taints, allocatable, Ready)."""
    meta, spec, status = body["metadata"], body.get("spec") or {}, body.get("status") or {}
    return {
        "metadata": {"name": meta["name"], "labels": dict(meta.get("labels") or {})},
        "spec": {
            "taints": list(spec.get("taints") or []),
            "unschedulable": bool(spec.get("unschedulable")),
        },
        "status": {
            "allocatable": dict(status.get("allocatable") or {}),
            "conditions": [
                {"type": c.get("type"), "status": c.get("status")}
                for c in status.get("conditions") or []
                if c.get("type") == "Ready"
            ],
        },
    }


def node_view(summary: Mapping[str, Any], alive_at: float | None) -> NodeView:
    conditions = {c["type"]: c["status"] for c in summary["status"]["conditions"]}
    return NodeView(
        name=summary["metadata"]["name"],
        ready=conditions.get("Ready") == "True",
        cordoned=summary["spec"]["unschedulable"],
        alive_at=alive_at,
    )


class Freshness:
    """When each watched value was last seen to change, by this process's clocks.

    ``silent_for`` is monotonic seconds since the value last changed (None until it has
    had one); a value first seen by a freshly started operator counts as just changed, so
    a restart gives every heartbeat a whole timeout before it is judged.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._seen: dict[Any, tuple[Any, float, float]] = {}
        self.clock = clock
        """What silences are measured by (heartbeats.py's ``LoopClock`` for the beats)."""

    def see(self, key: Any, value: Any) -> None:
        if value is None:
            return
        old = self._seen.get(key)
        if old is None or old[0] != value:
            self._seen[key] = (value, self.clock(), time.time())

    def value(self, key: Any) -> Any:
        """The value last seen (None where none was)."""
        seen = self._seen.get(key)
        return None if seen is None else seen[0]

    def silent_for(self, key: Any) -> float | None:
        seen = self._seen.get(key)
        return None if seen is None else self.clock() - seen[1]

    def changed_at(self, key: Any) -> float | None:
        """Wall-clock time of the last change seen (for marks kept in .status)."""
        seen = self._seen.get(key)
        return None if seen is None else seen[2]

    def drop(self, key: Any) -> None:
        """The object is gone (a DELETED event): nothing of it is kept."""
        self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)


@dataclasses.dataclass(frozen=True, slots=True)
class Marks:
    """When this process saw each watched value change: what the indexes do not keep."""

    beats: Freshness = dataclasses.field(default_factory=Freshness)
    """(namespace, pod) -> a rank's last heartbeat answer (heartbeats.py)."""
    tracked: Freshness = dataclasses.field(default_factory=Freshness)
    """(namespace, pod) -> when the heartbeat channel first saw it Running (its IP)."""
    kubelets: Freshness = dataclasses.field(default_factory=Freshness)
    """node -> its kubelet's Lease renewTime (kube-node-lease)."""
    phases: Freshness = dataclasses.field(default_factory=Freshness)
    """(namespace, pod) -> its phase."""
    trainers: dict[tuple[str, str], float] = dataclasses.field(default_factory=dict)
    """(namespace, pod) -> how long its trainers had not run, as its sidecar's last answer
    said (heartbeats.py; absent: no trainer of the pod has a liveness pulse)."""
    workers: Freshness = dataclasses.field(default_factory=Freshness)
    """(namespace, pod) -> how its worker ended (a ``WorkerExit``) while the launcher keeps
    the pod up, as its sidecar answered (heartbeats.py), and since when."""


JobKey: TypeAlias = tuple[str, str]
"""(namespace, job name): how every index is keyed."""


@dataclasses.dataclass(frozen=True, slots=True)
class Indexes:
    """kopf's in-memory indexes (handlers.py registers them), as a reconcile reads them."""

    pods: Mapping[JobKey, Iterable[dict[str, Any]]]  # pod_summary of each pod of the job
    usage: Mapping[str, Iterable[tuple[JobKey | None, Mapping[str, int]]]]
    """node -> (the job of a pod bound there, or None; what the pod requests)."""
    nodes: Mapping[str, Iterable[dict[str, Any]]]  # node name -> node_summary
    attempts: Mapping[Backend, Mapping[JobKey, Iterable[tuple[int, str]]]] = dataclasses.field(
        default_factory=dict
    )
    """Per backend of builders.CONTROLLED whose CRD is watched: each job's (attempt, why
    the controller failed it, or "")."""
    workloads: Mapping[JobKey, Iterable[WorkloadView]] | None = None
    """Each job's Kueue Workload, where Kueue's API is served (None: it is not)."""
    flavors: Mapping[str, Iterable[Flavor]] = dataclasses.field(default_factory=dict)
    """Kueue ResourceFlavor name -> what it adds to pods admitted on it."""
    priorities: Mapping[str, Iterable[int]] = dataclasses.field(default_factory=dict)
    """Kueue WorkloadPriorityClass name -> its value."""


ReadAttempt = Callable[[Backend, str, str], Mapping[str, Any] | None]
"""(backend, namespace, name) -> the attempt's PyTorchJob or TrainJob, or None where it
is gone (one GET)."""


def observe(
    spec: JobSpec,
    state: JobState,
    *,
    key: JobKey,
    uri: str,
    indexes: Indexes,
    marks: Marks,
    now: float,
    read_attempt: ReadAttempt,
    generation: int = 0,
    last_checkpoint: Mapping[str, Any] | None = None,
    refused: str = "",
) -> Observation:
    """One job's view of the cluster, from memory (and one GET for a PyTorchJob or a
    TrainJob only where its CRD appeared after start-up). ``generation``: the job's, as read;
    ``last_checkpoint``: what its rank 0 last reported (heartbeats.py); ``refused``: why
    the API refused an object of the current attempt as it was created."""
    namespace, name = key
    nodes = [n for found in indexes.nodes.values() for n in found]
    pods = [
        pod_view(
            s,
            marks.phases.silent_for((namespace, s["name"])),
            worker=_worker_exit(marks.workers, (namespace, s["name"])),
        )
        for s in indexes.pods.get(key, ())
    ]
    nodes_seen = [node_view(n, marks.kubelets.changed_at(n["metadata"]["name"])) for n in nodes]
    failure = ""
    if spec.backend in CONTROLLED and state.attempt and state.pods_created:
        failure = _controller_failure(spec.backend, key, state.attempt, indexes, read_attempt)
    current = [p for p in pods if p.attempt == state.attempt and not p.spare]
    beats = {p.node_rank: marks.beats.silent_for((namespace, p.name)) for p in current}
    used = _used_by_others(indexes, key)  # what other jobs' pods hold on each node
    queued = _queue(spec, key, indexes)
    footprint = rank_footprint(spec)
    fit = capacity.fitting_nodes_with(footprint, nodes, used)
    rejected = capacity.summarize_rejections(fit.rejected)
    return Observation(
        spec=spec,
        state=state,
        pods=pods,
        nodes=nodes_seen,
        beats=beats,
        unanswered={
            p.node_rank: waited
            for p in current
            if beats[p.node_rank] is None
            and (waited := marks.tracked.silent_for((namespace, p.name))) is not None
        },
        trainers={
            p.node_rank: silent
            for p in current
            if (silent := marks.trainers.get((namespace, p.name))) is not None
        },
        last_checkpoint=last_checkpoint,
        uri=uri,
        now=now,
        controller_failure=failure,
        fits=fit.fits,
        rejected=rejected,
        generation=generation,
        selector=job_selector(name),
        refused=refused,
        job=name,
        queue=queued,
    )


def _queue(spec: JobSpec, key: JobKey, indexes: Indexes) -> Queue | None:
    """What Kueue said of a queued job (None: the job names no queue)."""
    if spec.queue is None:
        return None
    if indexes.workloads is None:
        return Queue(spec.queue, installed=False)
    workload = next(iter(indexes.workloads.get(key, ())), None)
    flavors = {name: flavor for name, found in indexes.flavors.items() for flavor in found}
    values = {name: value for name, found in indexes.priorities.items() for value in found}
    return queue_of(spec.queue, workload, flavors, spec.priority_class, values)


def _worker_exit(workers: Freshness, key: tuple[str, str]) -> tuple[WorkerExit, float] | None:
    found, age = workers.value(key), workers.silent_for(key)
    return (found, age or 0.0) if isinstance(found, WorkerExit) else None


def job_selector(name: str) -> str:
    """The label selector of every pod of the job (status.selector, which the scale
    subresource serves to autoscalers)."""
    return f"{LABEL_JOB}={name}"


def _used_by_others(indexes: Indexes, key: JobKey) -> dict[str, dict[str, int]]:
    """What every other job's pods request on each node (this job's pods are what a new
    attempt replaces)."""
    used: dict[str, dict[str, int]] = {}
    for node, found in indexes.usage.items():
        on_node = used.setdefault(node, {})
        for job, requests in found:
            if job != key:
                for resource, amount in requests.items():
                    on_node[resource] = on_node.get(resource, 0) + amount
    return used


def _controller_failure(
    backend: Backend, key: JobKey, attempt: int, indexes: Indexes, read: ReadAttempt
) -> str:
    """Why the Kubeflow controller failed this attempt's PyTorchJob or TrainJob, or "".
    Its pods are judged like ours (they carry our labels); this is what only the
    controller knows."""
    index = indexes.attempts.get(backend)
    if index is not None:
        return next((why for seen, why in index.get(key, ()) if seen == attempt), "")
    namespace, name = key
    found = read(backend, namespace, attempt_name(name, attempt))  # CRD installed after start-up
    return "" if found is None else controller_failure(found)  # gone: its pods are seen going
