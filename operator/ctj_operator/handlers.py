"""kopf handlers: watch into indexes, decide (decisions.py), apply the plan. Nothing else.

Pods, nodes and Leases reach the operator through kopf indexes (one watch per kind, for
all jobs), so the reconcile of a job, a 1 s kopf timer, reads memory: at steady state it
sends no request at all. It observes, asks ``decide`` for a Plan, and applies its actions
in order. The first status write of a plan carries the resourceVersion the plan was made
from: if the job changed meanwhile (this process's view lagged), the write is a 409 and
nothing of the plan is applied; the next tick decides again from the newer view.

Every action is idempotent and status is written before the objects it describes are
created, so an operator killed at any moment converges on restart. Only the leader acts.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from . import builders, capacity
from .builders import ANNOTATION_CHECKPOINT_REQUEST, LABEL_JOB
from .decisions import (
    TERMINAL,
    CreateAttempt,
    DeleteAttempt,
    DeletePods,
    Emit,
    JobState,
    Observation,
    PatchStatus,
    Plan,
    Recovered,
    RequestCheckpoint,
    Restarted,
    conditions,
    decide,
    job_state,
    pod_rejected,
)
from .leader import LeaderElection
from .metrics import OperatorMetrics
from .observe import (
    Freshness,
    lease_summary,
    node_summary,
    node_view,
    pod_summary,
    pod_view,
)
from .spec import GROUP, PLURAL, VERSION, JobSpec, NodeCache, SpecError, job_checkpoint_uri

log = logging.getLogger("ctj.operator")
METRICS = OperatorMetrics()
BEATS = Freshness()  # (namespace, lease) -> a rank's heartbeat
KUBELETS = Freshness()  # node -> its kubelet's Lease in kube-node-lease
PHASES = Freshness()  # (namespace, pod) -> its phase
_FITS: dict[str, int] = {}  # job uid -> nodes that fit a rank, last logged
_WRITTEN: dict[str, str] = {}  # job uid -> resourceVersion of our last status write


class StaleView(Exception):
    """A status write was refused (409): the plan was made from an outdated job."""


class Cluster:
    """The API clients, made once at start-up (handlers stay plain functions)."""

    core: client.CoreV1Api
    custom: client.CustomObjectsApi
    coordination: client.CoordinationV1Api
    rbac: client.RbacAuthorizationV1Api
    sidecar_image: str = builders.DEFAULT_SIDECAR_IMAGE  # for specs that name none
    node_cache: NodeCache | None = None  # --node-cache-path/--node-cache-size (None: off)
    leader: LeaderElection | None = None
    pytorchjob_index = False  # the PyTorchJob CRD exists and is watched

    @classmethod
    def connect(
        cls,
        api: client.ApiClient,
        *,
        sidecar_image: str | None = None,
        node_cache: NodeCache | None = None,
    ) -> None:
        if sidecar_image:
            cls.sidecar_image = sidecar_image
        cls.node_cache = node_cache
        cls.core = client.CoreV1Api(api)
        cls.custom = client.CustomObjectsApi(api)
        cls.coordination = client.CoordinationV1Api(api)
        cls.rbac = client.RbacAuthorizationV1Api(api)


# ---- indexes: what the watches deliver, kept by kopf in memory ----
# Async (quick, pure) so they run on kopf's event loop: as sync handlers they would queue
# behind reconciles blocked on API calls in the thread pool, and a pod the operator has
# just created would stay unseen for tens of seconds under load.


@kopf.index("pods", labels={LABEL_JOB: kopf.PRESENT})
async def ctj_pods(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    summary = pod_summary(body)
    PHASES.see((namespace, summary["name"]), summary["phase"])
    return {(namespace, labels[LABEL_JOB]): summary}


@kopf.index("pods")
async def node_usage(
    namespace: str | None, labels: Mapping[str, str], spec: kopf.Spec, status: kopf.Status, **_: Any
) -> Any:
    """What every non-terminal pod bound to a node requests (the node's room taken)."""
    node = spec.get("nodeName")
    if not node or status.get("phase") in TERMINAL:
        return None
    job = (namespace, labels.get(LABEL_JOB)) if labels.get(LABEL_JOB) else None
    return {node: (job, capacity.pod_requests(dict(spec)))}


@kopf.index("nodes")
async def cluster_nodes(name: str, body: kopf.Body, **_: Any) -> Any:
    return {name: node_summary(body)}


@kopf.index("coordination.k8s.io", "v1", "leases", labels={LABEL_JOB: kopf.PRESENT})
async def ctj_leases(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    summary = lease_summary(body)
    BEATS.see((namespace, summary["name"]), summary["renew"])
    return {(namespace, labels[LABEL_JOB]): summary}


def _is_node_lease(namespace: str | None, **_: Any) -> bool:
    return namespace == "kube-node-lease"


@kopf.index("coordination.k8s.io", "v1", "leases", when=_is_node_lease)
async def kubelet_leases(name: str, spec: kopf.Spec, **_: Any) -> Any:
    KUBELETS.see(name, spec.get("renewTime"))
    return {name: spec.get("renewTime")}


# The indexes forget a deleted object by themselves; these marks go with it (the same
# watch streams: kopf serves every handler of a resource from one).


@kopf.on.event("pods", labels={LABEL_JOB: kopf.PRESENT})
async def pod_gone(event: kopf.RawEvent, namespace: str | None, name: str, **_: Any) -> None:
    if event["type"] == "DELETED":
        PHASES.drop((namespace, name))


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={LABEL_JOB: kopf.PRESENT})
async def lease_gone(event: kopf.RawEvent, namespace: str | None, name: str, **_: Any) -> None:
    if event["type"] == "DELETED":
        BEATS.drop((namespace, name))


@kopf.on.event("coordination.k8s.io", "v1", "leases", when=_is_node_lease)
async def kubelet_gone(event: kopf.RawEvent, name: str, **_: Any) -> None:
    if event["type"] == "DELETED":
        KUBELETS.drop(name)


async def ctj_pytorchjobs(
    namespace: str | None, labels: Mapping[str, str], body: kopf.Body, **_: Any
) -> Any:
    """Registered by __main__ only where the PyTorchJob CRD exists: (attempt, why the
    Kubeflow controller failed it, or "")."""
    attempt = int(labels.get(builders.LABEL_ATTEMPT, "0"))
    return {(namespace, labels[LABEL_JOB]): (attempt, builders.pytorchjob_failure(dict(body)))}


# ---- the reconcile ----


def _event(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    kopf.event(cast(kopf.Body, body), type=type_, reason=reason, message=message)


def _values(index: Any, key: Any) -> list[Any]:
    return list(index.get(key, ())) if index is not None else []


def _stale(uid: str, rv: str) -> bool:
    """The body is older than our own last write: wait for the watch to catch up."""
    written = _WRITTEN.get(uid)
    try:
        return written is not None and int(rv) < int(written)
    except ValueError:  # resourceVersions are opaque; etcd's are integers
        return False


@kopf.timer(GROUP, VERSION, PLURAL, interval=1.0, initial_delay=0.0)
def reconcile(body: kopf.Body, name: str, namespace: str | None, uid: str, **indexes: Any) -> None:
    """``indexes``: kopf passes each index by its function's name (ctj_pods, node_usage,
    cluster_nodes, ctj_leases, and ctj_pytorchjobs where registered)."""
    assert namespace is not None  # the CRD is namespaced
    if Cluster.leader is not None and not Cluster.leader.is_leader():
        return
    raw = dict(body)
    status = dict(body.get("status") or {})
    state = job_state(status)
    if _stale(uid, str(body.metadata.get("resourceVersion"))):
        return
    try:
        spec = JobSpec.parse(
            dict(body.get("spec") or {}),
            sidecar_image=Cluster.sidecar_image,
            node_cache=Cluster.node_cache,
        )
    except SpecError as exc:
        if status.get("phase") != "Failed":
            plan = Plan(
                (
                    PatchStatus(
                        {
                            "phase": "Failed",
                            "conditions": conditions(
                                state, "Failed", "InvalidSpec", str(exc), time.time()
                            ),
                        }
                    ),
                    Emit("Warning", "InvalidSpec", str(exc)),
                )
            )
            _apply(raw, None, plan, uri="")
        return
    METRICS.job_seen(namespace, name, state.phase, state.world_size, state.attempt)
    key = (namespace, name)
    uri = state.storage or job_checkpoint_uri(spec, namespace, name, uid)
    pods = [
        pod_view(s, PHASES.silent_for((namespace, s["name"])))
        for s in _values(indexes["ctj_pods"], key)
    ]
    failure = ""
    if spec.backend == "pytorchjob" and state.attempt and state.pods_created:
        failure = _pytorchjob_failure(name, namespace, state, indexes.get("ctj_pytorchjobs"))
    nodes = [s for store in indexes["cluster_nodes"].values() for s in store]
    leases = _values(indexes["ctj_leases"], key)
    obs = Observation(
        spec=spec,
        state=state,
        pods=pods,
        nodes=[node_view(n, KUBELETS.changed_at(n["metadata"]["name"])) for n in nodes],
        beats={
            s["rank"]: BEATS.silent_for((namespace, s["name"]))
            for s in leases
            if s["attempt"] == state.attempt
        },
        last_checkpoint=_last_checkpoint(leases),
        uri=uri,
        now=time.time(),
        controller_failure=failure,
        **_capacity(raw, spec, uri, nodes, indexes["node_usage"], key),
    )
    if _FITS.get(uid) != len(obs.fits):
        _FITS[uid] = len(obs.fits)
        log.info(
            "%s/%s: %d nodes fit a rank%s",
            namespace,
            name,
            len(obs.fits),
            f" ({obs.rejected})" if obs.rejected else "",
        )
    plan = decide(obs)
    if (
        plan.actions
        and plan.kinds() != ["PatchStatus"]
        or any(isinstance(a, Emit) for a in plan.actions)
    ):
        log.info("%s/%s attempt %d: %s", namespace, name, state.attempt, ", ".join(plan.kinds()))
    elif plan.note:
        log.debug("%s/%s: %s", namespace, name, plan.note)
    try:
        _apply(raw, spec, plan, uri=uri, obs=obs)
    except StaleView:
        log.info("%s/%s: the job changed since it was read; deciding again", namespace, name)


def _capacity(
    body: dict[str, Any],
    spec: JobSpec,
    uri: str,
    nodes: list[dict[str, Any]],
    usage: kopf.Index[Any, Any],
    key: tuple[str, str],
) -> dict[str, Any]:
    """Where one rank of this job fits, counting every other pod's requests."""
    pod = builders.build_pod(body, spec, uri=uri, attempt=1, world_size=1, node_rank=0)
    used: dict[str, dict[str, int]] = {}
    for node, store in usage.items():
        on_node = used.setdefault(node, {})
        for job, requests in store:
            if job != key:  # this job's pods are what a new attempt replaces
                for resource, amount in requests.items():
                    on_node[resource] = on_node.get(resource, 0) + amount
    fit = capacity.fitting_nodes_with(pod["spec"], nodes, used)
    return {"fits": fit.fits, "rejected": capacity.summarize_rejections(fit.rejected)}


def _last_checkpoint(leases: Iterable[Mapping[str, Any]]) -> dict[str, Any] | None:
    """The newest checkpoint rank 0's sidecar reported, over the attempts still leased."""
    best: dict[str, Any] | None = None
    for lease in leases:
        if lease["rank"] != 0 or not lease["checkpoint"]:
            continue
        try:
            found = json.loads(lease["checkpoint"])
            step = int(found["step"])
        except (ValueError, KeyError, TypeError):
            continue
        if best is None or step > int(best["step"]):
            best = {"step": step, "time": str(found.get("time", "")), "bytes": found.get("bytes")}
    return best


def _pytorchjob_failure(
    name: str, namespace: str, state: JobState, index: kopf.Index[Any, Any] | None
) -> str:
    """Why the Kubeflow controller failed this attempt's PyTorchJob, or "". Its pods are
    judged like ours (they carry our labels); this is what only the controller knows."""
    if index is not None:
        return next(
            (why for attempt, why in index.get((namespace, name), ()) if attempt == state.attempt),
            "",
        )
    try:  # the CRD appeared after start-up: read it (one GET per tick for this backend)
        job = Cluster.custom.get_namespaced_custom_object(
            "kubeflow.org",
            "v1",
            namespace,
            "pytorchjobs",
            builders.pytorchjob_name(name, state.attempt),
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
        return ""  # deleted: its pods go with it, and are seen going
    return builders.pytorchjob_failure(job)


# ---- applying a plan ----


def _apply(
    body: dict[str, Any],
    spec: JobSpec | None,
    plan: Plan,
    *,
    uri: str,
    obs: Observation | None = None,
) -> None:
    meta = body["metadata"]
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    rv = str(meta.get("resourceVersion"))
    for action in plan.actions:
        if isinstance(action, PatchStatus):
            rv = _patch_status(namespace, name, uid, dict(action.fields), rv)
            phase = action.fields.get("phase")
            if phase:
                METRICS.job_phase(namespace, name, phase)
            if action.fields.get("worldSize"):
                METRICS.world_size.labels(namespace=namespace, job_name=name).set(
                    action.fields["worldSize"]
                )
            if action.fields.get("attempt"):
                METRICS.attempt.labels(namespace=namespace, job_name=name).set(
                    action.fields["attempt"]
                )
        elif isinstance(action, CreateAttempt):
            assert spec is not None and obs is not None
            try:
                _create_attempt(body, spec, uri, action)
            except ApiException as exc:
                if exc.status in (409, 429) or exc.status is None or exc.status >= 500:
                    raise  # not the pod's fault: kopf retries the tick
                if _namespace_terminating(exc):  # the job goes with its namespace
                    log.info("%s/%s: namespace terminating, nothing started", namespace, name)
                    return
                message = _api_message(exc)
                log.warning(
                    "%s/%s: the attempt's objects were rejected: %s", namespace, name, message
                )
                rejected = pod_rejected(obs, action.attempt, action.world_size, message)
                body = {**body, "metadata": {**meta, "resourceVersion": rv}}
                _apply(body, spec, rejected, uri=uri, obs=obs)
                return
        elif isinstance(action, DeletePods):
            _delete_pods(namespace, action.names, force=action.force)
        elif isinstance(action, DeleteAttempt):
            _delete_attempt(namespace, name, spec, action.attempt)
        elif isinstance(action, RequestCheckpoint):
            assert spec is not None
            _request_checkpoint(namespace, name, spec, action)
        elif isinstance(action, Emit):
            _event(body, action.type, action.reason, action.message)
        elif isinstance(action, Restarted):
            METRICS.restarts.labels(reason=action.reason, cause=action.cause.value).inc()
        elif isinstance(action, Recovered):
            METRICS.recovery.observe(action.seconds)


def _patch_status(namespace: str, name: str, uid: str, fields: dict[str, Any], rv: str) -> str:
    """A merge patch of .status, conditional on the resourceVersion the plan was made
    from; returns the new resourceVersion, or raises StaleView on 409."""
    patch = {"metadata": {"resourceVersion": rv}, "status": fields}
    try:
        result = Cluster.custom.patch_namespaced_custom_object_status(
            GROUP, VERSION, namespace, PLURAL, name, patch
        )
    except ApiException as exc:
        if exc.status == 409:
            raise StaleView from exc
        raise
    new = str(result["metadata"]["resourceVersion"])
    _WRITTEN[uid] = new
    return new


def _namespace_terminating(exc: ApiException) -> bool:
    try:
        causes = (json.loads(exc.body or "{}").get("details") or {}).get("causes") or []
    except ValueError:
        return False
    return any(c.get("reason") == "NamespaceTerminating" for c in causes)


def _api_message(exc: ApiException) -> str:
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason)
    except ValueError:
        return str(exc.reason)


def _create(fn: Any, *args: Any, exists: Any = None) -> None:
    """Create, where already there (409: a retry after a restart) is success. ``exists``
    (a zero-argument read) settles a refusal: admission such as a ResourceQuota runs
    before the API server finds the name taken, so re-creating a pod that exists can be
    a 403 'exceeded quota' rather than a 409."""
    try:
        fn(*args)
    except ApiException as exc:
        if exc.status == 409:
            return
        if exists is not None and exc.status in (400, 403, 422):
            try:
                exists()
                return
            except ApiException as read:
                if read.status != 404:
                    raise exc from read
        raise


def _create_or_replace_role(namespace: str, role: dict[str, Any]) -> None:
    try:
        Cluster.rbac.create_namespaced_role(namespace, role)
    except ApiException as exc:
        if exc.status != 409:
            raise
        Cluster.rbac.patch_namespaced_role(role["metadata"]["name"], namespace, role)


def _create_attempt(body: dict[str, Any], spec: JobSpec, uri: str, action: CreateAttempt) -> None:
    namespace = body["metadata"]["namespace"]
    attempt, world_size = action.attempt, action.world_size
    # heartbeats first: a rank's sidecar renews a Lease that exists, under a Role naming it
    _create_or_replace_role(
        namespace,
        builders.build_heartbeat_role(body, spec, attempt=attempt, world_size=world_size),
    )
    _create(
        Cluster.rbac.create_namespaced_role_binding,
        namespace,
        builders.build_heartbeat_binding(body, spec),
    )
    for lease in builders.build_leases(body, spec, attempt=attempt, world_size=world_size):
        _create(Cluster.coordination.create_namespaced_lease, namespace, lease)
    if spec.checkpoint.node_cache is not None:  # made once per job; kept across attempts
        secret = builders.build_cache_secret(body, secrets.token_hex(32))
        _create(Cluster.core.create_namespaced_secret, namespace, secret)
    if spec.backend == "pytorchjob":
        job = builders.build_pytorchjob(
            body, spec, uri=uri, attempt=attempt, world_size=world_size, avoid=action.avoid
        )
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
            body,
            spec,
            uri=uri,
            attempt=attempt,
            world_size=world_size,
            node_rank=rank,
            avoid=action.avoid,
        )
        name = pod["metadata"]["name"]
        _create(
            Cluster.core.create_namespaced_pod,
            namespace,
            pod,
            exists=lambda name=name: Cluster.core.read_namespaced_pod(name, namespace),
        )


def _delete_pods(namespace: str, names: Iterable[str], *, force: bool) -> None:
    for pod in names:
        try:
            Cluster.core.delete_namespaced_pod(
                pod, namespace, grace_period_seconds=0 if force else 30
            )
        except ApiException as exc:
            if exc.status != 404:
                raise


def _delete_attempt(namespace: str, name: str, spec: JobSpec | None, attempt: int) -> None:
    if spec is not None and spec.backend == "pytorchjob":
        try:
            Cluster.custom.delete_namespaced_custom_object(
                "kubeflow.org",
                "v1",
                namespace,
                "pytorchjobs",
                builders.pytorchjob_name(name, attempt),
            )
        except ApiException as exc:
            if exc.status != 404:
                raise
    selector = f"{LABEL_JOB}={name},{builders.LABEL_ATTEMPT}={attempt}"
    Cluster.coordination.delete_collection_namespaced_lease(namespace, label_selector=selector)


def _request_checkpoint(
    namespace: str, name: str, spec: JobSpec, action: RequestCheckpoint
) -> None:
    """Annotate every rank's Lease: its sidecar sees it on the next beat and tells the
    trainer (docs/operator.md, "Planned transitions")."""
    patch = {"metadata": {"annotations": {ANNOTATION_CHECKPOINT_REQUEST: action.request_id}}}
    for rank in range(action.world_size):
        lease = builders.rank_pod_name(spec, name, action.attempt, rank)
        try:
            Cluster.coordination.patch_namespaced_lease(lease, namespace, patch)
        except ApiException as exc:
            if exc.status != 404:
                raise


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def forget(name: str, namespace: str | None, uid: str, **_: Any) -> None:
    """A deleted job leaves no series behind (its objects go by garbage collection)."""
    assert namespace is not None
    METRICS.job_phase(namespace, name, None)
    _WRITTEN.pop(uid, None)
    _FITS.pop(uid, None)
