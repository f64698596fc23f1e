"""Reading the cluster (and the checkpoint store) into the decisions' plain views."""

from __future__ import annotations

import base64
import logging
import time
from typing import Any

from kubernetes import client

from .builders import LABEL_ATTEMPT, LABEL_JOB, LABEL_RANK
from .decisions import JobState, NodeView, PodView

log = logging.getLogger("ctj.operator")
_UNSCHEDULABLE_TAINTS = ("NoSchedule", "NoExecute")


def node_views(core: client.CoreV1Api) -> list[NodeView]:
    views = []
    for node in core.list_node().items:
        conditions = {c.type: c.status for c in (node.status.conditions or [])}
        taints = node.spec.taints or []
        views.append(
            NodeView(
                name=node.metadata.name,
                ready=conditions.get("Ready") == "True",
                schedulable=not node.spec.unschedulable
                and not any(t.effect in _UNSCHEDULABLE_TAINTS for t in taints),
            )
        )
    return views


def job_pods(core: client.CoreV1Api, namespace: str, job: str) -> list[Any]:
    return core.list_namespaced_pod(namespace, label_selector=f"{LABEL_JOB}={job}").items


def pod_view(pod: Any) -> PodView:
    status = pod.status
    return PodView(
        name=pod.metadata.name,
        node_rank=int(pod.metadata.labels.get(LABEL_RANK, "0")),
        phase=status.phase or "Pending",
        node_name=pod.spec.node_name,
        terminating=pod.metadata.deletion_timestamp is not None,
        reason=status.reason,
    )


def attempt_of(pod: Any) -> int:
    return int(pod.metadata.labels.get(LABEL_ATTEMPT, "0"))


def job_state(status: dict[str, Any]) -> JobState:
    return JobState(
        phase=status.get("phase") or "Pending",
        attempt=int(status.get("attempt") or 0),
        world_size=int(status.get("worldSize") or 0),
        restarts=int(status.get("restarts") or 0),
        pods_created=bool(status.get("podsCreated")),
        not_before=status.get("notBefore"),
        capacity_since=status.get("capacitySince"),
    )


class CheckpointWatcher:
    """The last committed checkpoint of each job, read from its store at most every 10 s."""

    def __init__(self, core: client.CoreV1Api, every_s: float = 10.0) -> None:
        self.core = core
        self.every_s = every_s
        self._cache: dict[str, tuple[float, dict[str, Any] | None]] = {}

    def latest(
        self, namespace: str, uri: str, endpoint: str | None, secret: str | None
    ) -> dict[str, Any] | None:
        now = time.monotonic()
        cached = self._cache.get(uri)
        if cached and now - cached[0] < self.every_s:
            return cached[1]
        found = None
        try:
            found = self._read(namespace, uri, endpoint, secret)
        except Exception as exc:  # noqa: BLE001 - status is informative; never block reconcile
            log.warning("cannot read checkpoints at %s: %s", uri, str(exc).splitlines()[0])
        self._cache[uri] = (now, found)
        return found

    def _read(
        self, namespace: str, uri: str, endpoint: str | None, secret: str | None
    ) -> dict[str, Any] | None:
        from trainer_sidecar.store import repository
        from trainer_sidecar.store.base import Location
        from trainer_sidecar.store.local import LocalStore
        from trainer_sidecar.store.s3 import S3Settings, S3Store

        location = Location.parse(uri)
        if location.scheme == "file":
            store: Any = LocalStore(location.prefix, create=False)
        else:
            store = S3Store(
                location,
                S3Settings(endpoint_url=endpoint, max_attempts=2),
                credentials=self._credentials(namespace, secret),
            )
        latest = repository.latest_manifest(store)
        if latest is None:
            return None
        return {
            "step": latest.step,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(latest.created)),
            "bytes": latest.logical_bytes,
        }

    def _credentials(self, namespace: str, secret: str | None) -> dict[str, str] | None:
        if not secret:
            return None
        data = self.core.read_namespaced_secret(secret, namespace).data or {}
        return {
            k: base64.b64decode(v).decode()
            for k, v in data.items()
            if k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
        }
