"""What the watches deliver, reduced to the plain values the decisions read.

kopf keeps an index per watched kind (handlers.py registers them); each index entry is one
of the small dicts made here, so the reconcile reads memory, not the API server. Heartbeat
and kubelet Leases are judged by when *this process* saw them change (``Freshness``), never
by comparing another machine's clock with ours.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from .builders import (
    ANNOTATION_LAST_CHECKPOINT,
    KF_REPLICA_INDEX,
    KF_REPLICA_TYPE,
    LABEL_ATTEMPT,
    LABEL_JOB,
    LABEL_RANK,
)
from .decisions import NodeView, PodView


def node_rank(labels: Mapping[str, str]) -> int:
    """Our pods carry their rank; the Kubeflow controller's carry its replica type and
    index (the master is rank 0, worker i is rank i + 1, as it sets RANK)."""
    if LABEL_RANK in labels:
        return int(labels[LABEL_RANK])
    if labels.get(KF_REPLICA_TYPE) == "worker":
        return int(labels.get(KF_REPLICA_INDEX, "0")) + 1
    return 0


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
    return {
        "name": meta["name"],
        "attempt": int(labels.get(LABEL_ATTEMPT, "0")),
        "rank": node_rank(labels),
        "phase": status.get("phase") or "Pending",
        "node": spec.get("nodeName"),
        "terminating": meta.get("deletionTimestamp") is not None,
        "reason": status.get("reason"),
        "waiting": waiting,
    }


def pod_view(s: Mapping[str, Any], phase_age: float | None = None) -> PodView:
    return PodView(
        name=s["name"],
        attempt=s["attempt"],
        node_rank=s["rank"],
        phase=s["phase"],
        node_name=s["node"],
        terminating=s["terminating"],
        reason=s["reason"],
        waiting=s["waiting"],
        phase_age=phase_age,
    )


def job_of(labels: Mapping[str, str]) -> str | None:
    return labels.get(LABEL_JOB)


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


def lease_summary(body: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's heartbeat Lease: its renewTime and what rank 0 reports."""
    meta, spec = body["metadata"], body.get("spec") or {}
    labels, notes = meta.get("labels") or {}, meta.get("annotations") or {}
    return {
        "name": meta["name"],
        "attempt": int(labels.get(LABEL_ATTEMPT, "0")),
        "rank": node_rank(labels),
        "renew": spec.get("renewTime"),
        "checkpoint": notes.get(ANNOTATION_LAST_CHECKPOINT),
    }


class Freshness:
    """When each watched value was last seen to change, by this process's clocks.

    ``silent_for`` is monotonic seconds since the value last changed (None until it has
    had one); a value first seen by a freshly started operator counts as just changed, so
    a restart gives every heartbeat a whole timeout before it is judged.
    """

    def __init__(self) -> None:
        self._seen: dict[Any, tuple[Any, float, float]] = {}

    def see(self, key: Any, value: Any) -> None:
        if value is None:
            return
        old = self._seen.get(key)
        if old is None or old[0] != value:
            self._seen[key] = (value, time.monotonic(), time.time())

    def silent_for(self, key: Any) -> float | None:
        seen = self._seen.get(key)
        return None if seen is None else time.monotonic() - seen[1]

    def changed_at(self, key: Any) -> float | None:
        """Wall-clock time of the last change seen (for marks kept in .status)."""
        seen = self._seen.get(key)
        return None if seen is None else seen[2]

    def drop(self, key: Any) -> None:
        """The object is gone (a DELETED event): nothing of it is kept."""
        self._seen.pop(key, None)

    def __len__(self) -> int:
        return len(self._seen)
