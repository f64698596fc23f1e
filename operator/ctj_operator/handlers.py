"""kopf handlers: observe, decide (decisions.py), apply, write status. Nothing else.

One level-triggered reconcile per job runs every second (a kopf timer): it reads
the job's pods and the nodes, asks ``decide`` what to do, and applies it. Every
step is idempotent and the status is written *before* the objects it
describes are created, so an operator killed at any moment converges on
restart: a half-created attempt is completed, never duplicated (pod names are
deterministic), and pods of older attempts are always removed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import builders
from .decisions import Decision, JobState, PodView, decide
from .metrics import OperatorMetrics
from .observe import CheckpointWatcher, attempt_of, job_pods, job_state, node_views, pod_view
from .spec import GROUP, PLURAL, VERSION, JobSpec, SpecError, job_checkpoint_uri

log = logging.getLogger("ctj.operator")
METRICS = OperatorMetrics()


class Cluster:
    """The API clients, made once at start-up (handlers stay plain functions)."""

    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    checkpoints: CheckpointWatcher
    sidecar_image: str = builders.DEFAULT_SIDECAR_IMAGE  # for specs that name none

    @classmethod
    def connect(cls, api: client.ApiClient, *, sidecar_image: str | None = None) -> None:
        if sidecar_image:
            cls.sidecar_image = sidecar_image
        cls.core = client.CoreV1Api(api)
        cls.custom = client.CustomObjectsApi(api)
        cls.checkpoints = CheckpointWatcher(cls.core)


def _event(type_: str, body: dict[str, Any], *, reason: str, message: str) -> None:
    """A Kubernetes Event on the job (kopf takes its plain body dict as it is)."""
    kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message)


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _patch_status(namespace: str, name: str, status: dict[str, Any]) -> None:
    Cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": status}
    )


def _condition(
    body: dict[str, Any], kind: str, reason: str, message: str, *, restarted: bool = False
) -> list[dict[str, Any]]:
    """The job's conditions: the summary one (type = phase), replaced on each transition,
    and ``Restarted``, why the last attempt ended, which outlives the restart itself."""
    summary = {
        "type": kind,
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": _now_iso(),
    }
    if restarted:
        return [summary, {**summary, "type": "Restarted"}]
    kept = [
        c for c in (body.get("status") or {}).get("conditions") or [] if c["type"] == "Restarted"
    ]
    return [summary, *kept]


def _create(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except ApiException as exc:
        if exc.status != 409:  # already there: a retry after a restart
            raise


def _delete_pods(namespace: str, pods: list[Any]) -> None:
    for pod in pods:
        if pod.metadata.deletion_timestamp is not None:
            continue
        try:
            Cluster.core.delete_namespaced_pod(
                pod.metadata.name, namespace, grace_period_seconds=30
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


def _fail(body: dict[str, Any], namespace: str, name: str, reason: str, message: str) -> None:
    _patch_status(
        namespace,
        name,
        {"phase": "Failed", "conditions": _condition(body, "Failed", reason, message)},
    )
    _event("Warning", body, reason=reason, message=message)
    METRICS.job_phase(namespace, name, "Failed")


@kopf.timer(GROUP, VERSION, PLURAL, interval=1.0, initial_delay=0.0)
def reconcile(body: kopf.Body, name: str, namespace: str | None, uid: str, **_: Any) -> None:
    assert namespace is not None  # the CRD is namespaced
    status = dict(body.get("status") or {})
    try:
        spec = JobSpec.parse(dict(body.get("spec") or {}), sidecar_image=Cluster.sidecar_image)
    except SpecError as exc:
        if status.get("phase") != "Failed":
            _fail(dict(body), namespace, name, "InvalidSpec", str(exc))
        return
    state = job_state(status)
    uri = job_checkpoint_uri(spec, namespace, name, uid)
    pods = job_pods(Cluster.core, namespace, name)
    stale = [p for p in pods if attempt_of(p) != state.attempt]
    if stale:
        _delete_pods(namespace, stale)  # older attempts never outlive a restart
    current = [p for p in pods if attempt_of(p) == state.attempt]
    if state.phase == "Restarting" and state.attempt:
        # the attempt is over: finish tearing it down, were the operator stopped right
        # after writing Restarting (deletes are idempotent; terminating pods are skipped)
        _teardown_attempt(dict(body), spec, state.attempt, current)
    views = [
        pod_view(p)
        for p in current
        if p.metadata.deletion_timestamp is None or p.status.phase not in ("Succeeded",)
    ]
    if spec.backend == "pytorchjob" and state.attempt and state.pods_created:
        views = _pytorchjob_views(namespace, name, state)
    now = time.time()
    decision = decide(spec, state, views, node_views(Cluster.core), now)
    if decision.action not in ("none", "wait") or decision.reason:
        log.info(
            "%s/%s attempt %d: %s %s %s",
            namespace,
            name,
            state.attempt,
            decision.action,
            decision.reason,
            decision.message,
        )
    apply(dict(body), spec, state, decision, uri=uri, pods=current, now=now)
    _observe_progress(dict(body), spec, state, uri, current, status, now)


def _pytorchjob_views(namespace: str, name: str, state: JobState) -> list[PodView]:
    """The attempt's PyTorchJob, read back as one view per node rank."""
    try:
        job = Cluster.custom.get_namespaced_custom_object(
            "kubeflow.org", "v1", namespace, "pytorchjobs", f"{name}-a{state.attempt}"
        )
    except ApiException as exc:
        if exc.status == 404:
            return []  # deleted: the attempt is over
        raise
    phase = builders.pytorchjob_phase(job)
    return [
        PodView(f"{name}-a{state.attempt}", rank, phase, None, reason="PyTorchJob")
        for rank in range(state.world_size)
    ]


def apply(
    body: dict[str, Any],
    spec: JobSpec,
    state: JobState,
    decision: Decision,
    *,
    uri: str,
    pods: list[Any],
    now: float,
) -> None:
    meta = body["metadata"]
    namespace, name = meta["namespace"], meta["name"]
    if decision.action == "start":
        attempt = state.attempt + 1
        _patch_status(
            namespace,
            name,
            {
                "phase": "Running",
                "attempt": attempt,
                "worldSize": decision.world_size,
                "podsCreated": False,
                "notBefore": None,
                "capacitySince": None,
                "selector": f"{builders.LABEL_JOB}={name}",
                "conditions": _condition(body, "Running", decision.reason, decision.message),
            },
        )
        _event("Normal", body, reason="AttemptStarted", message=decision.message)
        _create_attempt(body, spec, uri, attempt, decision.world_size)
        _patch_status(namespace, name, {"podsCreated": True})
        METRICS.world_size.labels(namespace=namespace, job_name=name).set(decision.world_size)
        METRICS.job_phase(namespace, name, "Running")
    elif decision.action == "create_pods":
        _create_attempt(body, spec, uri, state.attempt, state.world_size)
        _patch_status(namespace, name, {"podsCreated": True})
    elif decision.action == "restart":
        restarts = state.restarts + (1 if decision.counts_as_failure else 0)
        # recovery is timed from the first failure a restart answers; a resize is none
        failure_seen = (body.get("status") or {}).get("failureSeenAt") or (
            now if decision.counts_as_failure else None
        )
        _patch_status(
            namespace,
            name,
            {
                "phase": "Restarting",
                "restarts": restarts,
                "notBefore": decision.not_before,
                "failureSeenAt": failure_seen,
                "podsCreated": False,
                "conditions": _condition(
                    body, "Restarting", decision.reason, decision.message, restarted=True
                ),
            },
        )
        _event(
            "Warning" if decision.counts_as_failure else "Normal",
            body,
            reason=decision.reason,
            message=f"restarting: {decision.message}",
        )
        METRICS.restarts.labels(reason=decision.reason).inc()
        METRICS.job_phase(namespace, name, "Restarting")
        _teardown_attempt(body, spec, state.attempt, pods)
    elif decision.action == "succeed":
        _patch_status(
            namespace,
            name,
            {
                "phase": "Succeeded",
                "conditions": _condition(body, "Succeeded", decision.reason, decision.message),
            },
        )
        _event("Normal", body, reason="Succeeded", message=decision.message)
        METRICS.job_phase(namespace, name, "Succeeded")
    elif decision.action == "fail":
        _teardown_attempt(body, spec, state.attempt, pods)
        _fail(body, namespace, name, decision.reason, decision.message)
    elif decision.action == "wait" and decision.reason == "InsufficientNodes":
        conds = (body.get("status") or {}).get("conditions") or []
        if not conds or conds[0].get("reason") != decision.reason:
            _patch_status(
                namespace,
                name,
                {
                    "phase": state.phase if state.attempt else "Pending",
                    "conditions": _condition(body, "Waiting", decision.reason, decision.message),
                },
            )
            _event("Warning", body, reason=decision.reason, message=decision.message)
    if decision.action in ("none", "wait") and decision.capacity_since != state.capacity_since:
        _patch_status(namespace, name, {"capacitySince": decision.capacity_since})


def _create_attempt(
    body: dict[str, Any], spec: JobSpec, uri: str, attempt: int, world_size: int
) -> None:
    namespace = body["metadata"]["namespace"]
    if spec.backend == "pytorchjob":
        job = builders.build_pytorchjob(body, spec, uri=uri, attempt=attempt, world_size=world_size)
        _create(
            Cluster.custom.create_namespaced_custom_object,
            "kubeflow.org",
            "v1",
            namespace,
            "pytorchjobs",
            job,
        )
        return
    _create(Cluster.core.create_namespaced_service, namespace, builders.build_service(body))
    for rank in range(world_size):
        pod = builders.build_pod(
            body, spec, uri=uri, attempt=attempt, world_size=world_size, node_rank=rank
        )
        _create(Cluster.core.create_namespaced_pod, namespace, pod)


def _teardown_attempt(body: dict[str, Any], spec: JobSpec, attempt: int, pods: list[Any]) -> None:
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    if spec.backend == "pytorchjob":
        try:
            Cluster.custom.delete_namespaced_custom_object(
                "kubeflow.org", "v1", namespace, "pytorchjobs", f"{name}-a{attempt}"
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    _delete_pods(namespace, pods)


def _observe_progress(
    body: dict[str, Any],
    spec: JobSpec,
    state: JobState,
    uri: str,
    pods: list[Any],
    status: dict[str, Any],
    now: float,
) -> None:
    """Recovery time, the last checkpoint, and (pytorchjob) the PyTorchJob's own phase."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    update: dict[str, Any] = {}
    running = (
        bool(pods)
        and len(pods) >= state.world_size
        and all(p.status.phase == "Running" for p in pods)
    )
    if state.phase == "Running" and status.get("failureSeenAt") and running:
        METRICS.recovery.observe(max(0.0, now - float(status["failureSeenAt"])))
        update["failureSeenAt"] = None
    latest = Cluster.checkpoints.latest(
        namespace, uri, spec.checkpoint.endpoint, spec.checkpoint.credentials_secret
    )
    if latest and latest != status.get("lastCheckpoint"):
        update["lastCheckpoint"] = latest
    if update:
        _patch_status(namespace, name, update)
