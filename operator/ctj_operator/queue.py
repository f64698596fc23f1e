"""Kueue, as this operator drives it: pure.

A job labelled ``kueue.x-k8s.io/queue-name`` (as every Kueue-managed job is) runs only
once Kueue admits it. Kueue compiles in no integration for our kind, so the operator
does what Kueue's own job integrations do (its jobframework), for one Workload per job:

- it creates the job's ``Workload`` (kueue.x-k8s.io/v1beta2, owned by the job): one
  pod set of ``spec.replicas`` rank pods, ``minCount`` ``spec.minReplicas`` (Kueue's
  partial admission), each pod the exact template the ranks are made from (sidecar and
  its requests included); a ``kueue.x-k8s.io/priority-class`` label on the job names a
  WorkloadPriorityClass, whose value the Workload carries as its priority;
- it starts an attempt only while the Workload is ``Admitted``, at no more ranks than
  the admitted count, with the node labels and tolerations of the admitted
  ResourceFlavors;
- it says ``PodsReady`` once every rank runs (Kueue v0.19 evicts a Workload that does not
  within its waitForPodsReady timeout);
- an ``Evicted`` Workload (a preemption, a stopped queue, ``spec.active`` false) stops the
  job as a planned transition (a checkpoint at the next step boundary first), and once
  no pod is left the operator releases the quota (``status.admission`` cleared,
  ``QuotaReserved`` and ``Admitted`` False, ``Requeued``): Kueue requeues it;
- a job that ends marks its Workload ``Finished`` (the quota goes back at once).

Kueue's names live here; decisions.py asks these functions, render.py sends their
objects. docs/operator.md, "Queued by Kueue".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

from ctj_contract import rfc3339

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
WORKLOADS = "workloads"
QUEUE_LABEL = f"{GROUP}/queue-name"
"""On the job: the LocalQueue (in the job's namespace) that admits it."""
PRIORITY_LABEL = f"{GROUP}/priority-class"
"""On the job: a WorkloadPriorityClass, as on any Kueue-managed job."""
JOB_UID_LABEL = f"{GROUP}/job-uid"
"""On the Workload: its job's uid (Kueue names it in its preemption messages)."""
POD_SET = "ranks"
REQUEUED_ON = ("Preempted", "NodeFailures")
"""Eviction reasons after which Kueue requeues at once (jobframework's rule)."""


def workload_name(job: str) -> str:
    """The job's Workload (a job's name leaves room for it: names.py)."""
    return f"{job}-ctj"


@dataclasses.dataclass(frozen=True, slots=True)
class Flavor:
    """What a ResourceFlavor adds to the pods Kueue admitted on it."""

    node_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    tolerations: tuple[Mapping[str, Any], ...] = ()


def flavor_of(body: Mapping[str, Any]) -> Flavor:
    spec = body.get("spec") or {}
    return Flavor(dict(spec.get("nodeLabels") or {}), tuple(spec.get("tolerations") or ()))


class Write(enum.StrEnum):
    """A status write of the job's Workload (``status_patch`` makes it)."""

    READY = "PodsReady"  # every rank runs
    RELEASE = "release"  # an evicted Workload's quota given back, its pods gone
    SUCCEEDED = "Succeeded"  # the job ended: Finished
    FAILED = "Failed"


@dataclasses.dataclass(frozen=True, slots=True)
class WorkloadView:
    """The job's Workload as the watch last delivered it: plain facts (decisions.py reads
    them; only this module interprets Kueue's conditions)."""

    name: str
    resource_version: str
    conditions: tuple[Mapping[str, Any], ...] = ()
    admitted_count: int | None = None
    """The ranks admitted (status.admission); None: not admitted."""
    flavors: tuple[str, ...] = ()
    """The ResourceFlavors the admission assigned."""
    count: int = 0
    """The pod set's count, as created (spec.replicas then)."""
    admitted: bool = False
    quota_reserved: bool = False
    pods_ready: bool = False
    finished: bool = False
    evicted: str = ""
    """Why Kueue evicted it ("<reason>: <message>"), or "" while it has not."""


def _holds(conditions: Sequence[Mapping[str, Any]], kind: str) -> bool:
    return any(c.get("type") == kind and c.get("status") == "True" for c in conditions)


def workload_view(body: Mapping[str, Any]) -> WorkloadView:
    """From the Workload object (what the operator's index keeps)."""
    status = body.get("status") or {}
    conditions = tuple(dict(c) for c in status.get("conditions") or ())
    assignments = (status.get("admission") or {}).get("podSetAssignments") or []
    mine = next((a for a in assignments if a.get("name") == POD_SET), None)
    sets = (body.get("spec") or {}).get("podSets") or []
    count = next((int(s.get("count", 1)) for s in sets if s.get("name") == POD_SET), 0)
    evicted = next((c for c in conditions if c.get("type") == "Evicted"), {})
    return WorkloadView(
        name=str(body["metadata"]["name"]),
        resource_version=str(body["metadata"].get("resourceVersion") or ""),
        conditions=conditions,
        admitted_count=None if mine is None else int(mine.get("count", count)),
        flavors=tuple(sorted(set((mine or {}).get("flavors", {}).values()))),
        count=count,
        admitted=_holds(conditions, "Admitted") and mine is not None,
        quota_reserved=_holds(conditions, "QuotaReserved"),
        pods_ready=_holds(conditions, "PodsReady"),
        finished=_holds(conditions, "Finished"),
        evicted=(
            f"{evicted.get('reason') or 'Evicted'}: {evicted.get('message') or ''}"
            if evicted.get("status") == "True"
            else ""
        ),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Queue:
    """What the reconcile knows of a queued job's admission (``queue_of`` makes it)."""

    name: str
    """The LocalQueue the job's label names."""
    installed: bool
    """Kueue's Workload API is served (the operator watches it)."""
    workload: WorkloadView | None = None
    """The job's Workload; None: not made yet."""
    priority: tuple[str, int] | None = None
    """(WorkloadPriorityClass, its value) where the job's label names one that exists."""
    priority_missing: str = ""
    """The WorkloadPriorityClass the label names where none of that name exists."""
    node_labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """What the admitted flavors add to the pods' nodeSelector (merged, in order)."""
    tolerations: tuple[Mapping[str, Any], ...] = ()
    """And to their tolerations."""


def queue_of(
    name: str,
    workload: WorkloadView | None,
    flavors: Mapping[str, Flavor],
    priority_class: str | None,
    priorities: Mapping[str, int],
) -> Queue:
    """A queued job's ``Queue`` from what the watches hold: its Workload, the flavors it
    was admitted on, its priority class's value."""
    labels: dict[str, str] = {}
    tolerations: list[Mapping[str, Any]] = []
    for flavor_name in workload.flavors if workload else ():
        flavor = flavors.get(flavor_name, Flavor())
        labels.update(flavor.node_labels)
        tolerations += [dict(t) for t in flavor.tolerations if dict(t) not in tolerations]
    priority, missing = None, ""
    if priority_class is not None:
        value = priorities.get(priority_class)
        priority = None if value is None else (priority_class, value)
        missing = priority_class if value is None else ""
    return Queue(name, True, workload, priority, missing, labels, tuple(tolerations))


def build_workload(
    owner: Mapping[str, Any],
    *,
    namespace: str,
    queue: str,
    count: int,
    min_count: int,
    pod_spec: Mapping[str, Any],
    priority: tuple[str, int] | None,
    labels: Mapping[str, str],
) -> dict[str, Any]:
    """The job's Workload: ``owner`` the job's owner reference (garbage-collected with it),
    one pod set."""
    pod_set: dict[str, Any] = {
        "name": POD_SET,
        "count": count,
        "template": {"metadata": {"labels": dict(labels)}, "spec": dict(pod_spec)},
    }
    if min_count < count:
        pod_set["minCount"] = min_count
    spec: dict[str, Any] = {"queueName": queue, "podSets": [pod_set]}
    if priority is not None:
        name, value = priority
        ref = {"group": GROUP, "kind": "WorkloadPriorityClass", "name": name}
        spec |= {"priorityClassRef": ref, "priority": value}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Workload",
        "metadata": {
            "name": workload_name(owner["name"]),
            "namespace": namespace,
            "labels": {**labels, JOB_UID_LABEL: owner["uid"]},
            "ownerReferences": [dict(owner)],
        },
        "spec": spec,
    }


def _with(
    conditions: Sequence[Mapping[str, Any]], kind: str, status: bool, reason: str, message: str,
    now: float,
) -> list[dict[str, Any]]:  # fmt: skip
    """``conditions`` with ``kind`` set; its lastTransitionTime moves only with its status."""
    value = "True" if status else "False"
    old = next((c for c in conditions if c.get("type") == kind), None)
    since = old.get("lastTransitionTime") if old and old.get("status") == value else None
    new = {"type": kind, "status": value, "reason": reason, "message": message,
           "lastTransitionTime": since or rfc3339(now)}  # fmt: skip
    return [*(dict(c) for c in conditions if c.get("type") != kind), new]


def status_patch(workload: WorkloadView, write: Write, message: str, now: float) -> dict[str, Any]:
    """The Workload status write Kueue's own job integrations make (jobframework's):
    PodsReady True once every rank runs; on release, no admission, QuotaReserved and
    Admitted False, and Requeued (True where Kueue requeues at once: a preemption, lost
    nodes); Finished with the job's outcome. ``message``: why (the job's condition's, or
    the eviction's)."""
    conditions: Sequence[Mapping[str, Any]] = workload.conditions
    if write is Write.READY:
        text = "All pods reached readiness and the workload is running"
        return {"conditions": _with(conditions, "PodsReady", True, "Started", text, now)}
    if write is Write.RELEASE:
        reason = workload.evicted.split(":", 1)[0] or "Evicted"
        out = _with(conditions, "Requeued", reason in REQUEUED_ON, reason, message, now)
        out = _with(out, "QuotaReserved", False, "Pending", message, now)
        out = _with(out, "Admitted", False, "NoReservation", "The workload has no reservation",
                    now)  # fmt: skip
        return {"admission": None, "conditions": out}
    return {"conditions": _with(conditions, "Finished", True, write.value, message, now)}
